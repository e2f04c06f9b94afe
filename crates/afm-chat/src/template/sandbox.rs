//! Out-of-process rendering of chat templates. A template from a model file can build values
//! without bound within its fuel budget (a string doubled 60 times is an exabyte), minijinja has
//! no hook where memory could be counted, and an allocator that refuses aborts the whole process.
//! So a server renders in worker processes — its own binary, started with a hidden argument —
//! each under RLIMIT_AS (memory) and a fresh RLIMIT_CPU per render, while the parent keeps a
//! wall-clock deadline. A template that overruns kills only its worker: its request gets a clear
//! error and the next render starts a fresh worker.
//!
//! ```text
//!   server thread ──frame──▶ worker stdin     frame = u32 LE length + JSON
//!                 ◀─frame─── worker stdout    {"load": ..} when the worker holds another
//!                                             template, then {"render": ..} per request
//!                 ◀───────── worker stderr    read only after a death (Rust's
//!                                             "memory allocation of N bytes failed")
//! ```
//!
//! It owns the pool of workers ([`TemplateSandbox`], shareable by several templates) and the
//! protocol; rendering itself is [`super::ChatTemplate`]'s, run unchanged inside the worker.
//! Unix only (rlimits, poll).

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

use super::{ChatTemplate, RenderLimits};
use crate::ChatError;

/// How the workers are started and bounded.
#[derive(Clone, Debug)]
pub struct SandboxConfig {
    /// The worker program and its arguments (e.g. the `afm` binary, `__template-worker`); it
    /// must call [`serve_worker`].
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// Extra environment for the worker.
    pub env: Vec<(OsString, OsString)>,
    /// Address space of one worker (RLIMIT_AS), binary and libraries included.
    pub memory_bytes: u64,
    /// CPU seconds per render (RLIMIT_CPU, re-armed before each render).
    pub cpu_seconds: u64,
    /// Wall-clock time per render (and per worker start).
    pub timeout: Duration,
    /// Renders at once; more wait for a free worker.
    pub max_workers: usize,
}

impl SandboxConfig {
    pub fn new(program: impl Into<PathBuf>, args: &[&str]) -> Self {
        SandboxConfig {
            program: program.into(),
            args: args.iter().map(OsString::from).collect(),
            env: Vec::new(),
            memory_bytes: 512 << 20,
            cpu_seconds: 10,
            timeout: Duration::from_secs(10),
            max_workers: 4,
        }
    }
}

/// What a worker needs to render: the template, its specials, and every limit.
#[derive(Serialize, Deserialize)]
struct Load {
    source: String,
    bos: String,
    eos: String,
    max_output_bytes: usize,
    fuel: u64,
    max_recursion: usize,
    memory_bytes: u64,
    cpu_seconds: u64,
}

/// One render, borrowed on the server's side.
#[derive(Serialize)]
struct RenderRef<'a> {
    messages: &'a [Json],
    tools: Option<&'a [Json]>,
    add_generation_prompt: bool,
    kwargs: &'a Map<String, Json>,
}

#[derive(Deserialize)]
struct RenderOwned {
    messages: Vec<Json>,
    tools: Option<Vec<Json>>,
    add_generation_prompt: bool,
    kwargs: Map<String, Json>,
}

#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum Request<'a> {
    Load(&'a Load),
    Render(&'a RenderRef<'a>),
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum Received {
    Load(Load),
    Render(RenderOwned),
}

/// The worker's answer; a [`ChatError`] crosses as one of these.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Reply {
    Ok(String),
    Template(String),
    Raised(String),
    OutputTooLarge(usize),
}

impl Reply {
    fn into_result(self) -> Result<String, ChatError> {
        match self {
            Reply::Ok(text) => Ok(text),
            Reply::Template(m) => Err(ChatError::Template(m)),
            Reply::Raised(m) => Err(ChatError::TemplateRaised(m)),
            Reply::OutputTooLarge(limit) => Err(ChatError::TemplateOutputTooLarge { limit }),
        }
    }

    fn from_result(r: Result<String, ChatError>) -> Self {
        match r {
            Ok(text) => Reply::Ok(text),
            Err(ChatError::Template(m)) => Reply::Template(m),
            Err(ChatError::TemplateRaised(m)) => Reply::Raised(m),
            Err(ChatError::TemplateOutputTooLarge { limit }) => Reply::OutputTooLarge(limit),
            Err(other) => Reply::Template(other.to_string()),
        }
    }
}

/// A pool of worker processes; templates share it through [`ChatTemplate::sandboxed`].
pub struct TemplateSandbox {
    config: SandboxConfig,
    pool: Mutex<Pool>,
    freed: Condvar,
    /// Ids for the templates rendered here, so a worker knows which one it holds.
    next_template: AtomicU64,
}

struct Pool {
    idle: Vec<Worker>,
    /// Workers alive, idle or rendering.
    live: usize,
}

/// A template's side of the sandbox: the pool, and what a worker needs to load it.
pub(crate) struct Sandboxed {
    sandbox: Arc<TemplateSandbox>,
    id: u64,
    load: Load,
}

impl TemplateSandbox {
    pub fn new(config: SandboxConfig) -> Arc<Self> {
        Arc::new(TemplateSandbox {
            config,
            pool: Mutex::new(Pool {
                idle: Vec::new(),
                live: 0,
            }),
            freed: Condvar::new(),
            next_template: AtomicU64::new(0),
        })
    }

    /// Registers `template` and loads it into a worker, so a wrong program or a template the
    /// worker cannot compile fails here, at load, rather than at the first request.
    pub(crate) fn adopt(self: &Arc<Self>, template: &ChatTemplate) -> Result<Sandboxed, ChatError> {
        let limits = template.limits;
        let sandboxed = Sandboxed {
            sandbox: self.clone(),
            id: self.next_template.fetch_add(1, Ordering::Relaxed),
            load: Load {
                source: template.source.clone(),
                bos: template.bos_token.clone(),
                eos: template.eos_token.clone(),
                max_output_bytes: limits.max_output_bytes,
                fuel: limits.fuel,
                max_recursion: limits.max_recursion,
                memory_bytes: self.config.memory_bytes,
                cpu_seconds: self.config.cpu_seconds,
            },
        };
        let mut worker = self.take()?;
        if let Err(e) = self.ensure_loaded(&mut worker, &sandboxed) {
            return Err(self.end(worker, e));
        }
        self.give_back(worker);
        Ok(sandboxed)
    }

    fn render(&self, template: &Sandboxed, request: &RenderRef<'_>) -> Result<String, ChatError> {
        let frame = serde_json::to_vec(&Request::Render(request))
            .map_err(|e| ChatError::Template(format!("encoding the render request: {e}")))?;
        let mut worker = self.take()?;
        if let Err(e) = self.ensure_loaded(&mut worker, template) {
            return Err(self.end(worker, e));
        }
        match worker.call(&frame, self.config.timeout, reply_limit(&template.load)) {
            Ok(reply) => {
                self.give_back(worker);
                reply.into_result()
            }
            Err(failure) => {
                let err = worker.post_mortem(failure, &self.config);
                self.retire();
                Err(err)
            }
        }
    }

    /// Loads `template` into `worker` unless it holds it already.
    fn ensure_loaded(&self, worker: &mut Worker, template: &Sandboxed) -> Result<(), Ended> {
        if worker.loaded == Some(template.id) {
            return Ok(());
        }
        worker.loaded = None;
        let frame = serde_json::to_vec(&Request::Load(&template.load)).map_err(|e| {
            Ended::Alive(ChatError::Template(format!("encoding the template: {e}")))
        })?;
        match worker.call(&frame, self.config.timeout, reply_limit(&template.load)) {
            Ok(Reply::Ok(_)) => {
                worker.loaded = Some(template.id);
                Ok(())
            }
            Ok(refused) => Err(Ended::Alive(refused.into_result().err().unwrap_or_else(
                || ChatError::TemplateRenderer("the worker did not load the template".into()),
            ))),
            Err(failure) => Err(Ended::Dead(failure)),
        }
    }

    /// After a failed load: a live worker goes back to the pool, a dead one is buried.
    fn end(&self, worker: Worker, ended: Ended) -> ChatError {
        match ended {
            Ended::Alive(e) => {
                self.give_back(worker);
                e
            }
            Ended::Dead(failure) => {
                let e = worker.post_mortem(failure, &self.config);
                self.retire();
                e
            }
        }
    }

    /// An idle worker, else a new one (up to `max_workers`), else the next one freed.
    fn take(&self) -> Result<Worker, ChatError> {
        let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(worker) = pool.idle.pop() {
                return Ok(worker);
            }
            if pool.live < self.config.max_workers.max(1) {
                pool.live += 1;
                drop(pool);
                return self.spawn().inspect_err(|_| self.retire());
            }
            pool = self
                .freed
                .wait(pool)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn give_back(&self, worker: Worker) {
        let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        pool.idle.push(worker);
        self.freed.notify_one();
    }

    /// A worker died or was never started: its place is free.
    fn retire(&self) {
        let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        pool.live = pool.live.saturating_sub(1);
        self.freed.notify_one();
    }

    fn spawn(&self) -> Result<Worker, ChatError> {
        let c = &self.config;
        let mut child = Command::new(&c.program)
            .args(&c.args)
            .envs(c.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                ChatError::TemplateRenderer(format!("cannot start {}: {e}", c.program.display()))
            })?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(ChatError::TemplateRenderer(
                "the worker's pipes were not set up".into(),
            ));
        };
        Ok(Worker {
            child,
            stdin,
            stdout,
            stderr,
            loaded: None,
        })
    }
}

impl Sandboxed {
    pub(crate) fn render(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Json>,
    ) -> Result<String, ChatError> {
        let request = RenderRef {
            messages,
            tools,
            add_generation_prompt,
            kwargs,
        };
        self.sandbox.render(self, &request)
    }
}

/// The largest reply a well-behaved worker can send: the output limit, JSON-escaped.
fn reply_limit(load: &Load) -> usize {
    load.max_output_bytes.saturating_mul(6).saturating_add(4096)
}

impl Drop for TemplateSandbox {
    fn drop(&mut self) {
        let pool = self.pool.get_mut().unwrap_or_else(PoisonError::into_inner);
        for mut worker in pool.idle.drain(..) {
            worker.stop();
        }
    }
}

/// How loading a template into a worker failed.
enum Ended {
    /// The worker answered with an error (the template does not compile there).
    Alive(ChatError),
    Dead(Failure),
}

/// Why a call got no reply.
enum Failure {
    TimedOut,
    /// The pipe closed or broke: the worker died.
    Died,
    /// The worker wrote something that is not a reply.
    Garbled(String),
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
    stderr: ChildStderr,
    /// The id of the template it holds.
    loaded: Option<u64>,
}

impl Worker {
    fn call(
        &mut self,
        frame: &[u8],
        timeout: Duration,
        max_reply: usize,
    ) -> Result<Reply, Failure> {
        let deadline = Instant::now() + timeout;
        let len = u32::try_from(frame.len())
            .map_err(|_| Failure::Garbled(format!("a {} byte request", frame.len())))?;
        // An idle worker is blocked reading its stdin, so these writes cannot stall for long.
        self.stdin
            .write_all(&len.to_le_bytes())
            .and_then(|()| self.stdin.write_all(frame))
            .and_then(|()| self.stdin.flush())
            .map_err(|_| Failure::Died)?;
        let mut head = [0u8; 4];
        read_until(&mut self.stdout, &mut head, deadline)?;
        let len = u32::from_le_bytes(head) as usize;
        if len > max_reply {
            return Err(Failure::Garbled(format!("a {len} byte reply")));
        }
        let mut body = vec![0u8; len];
        read_until(&mut self.stdout, &mut body, deadline)?;
        serde_json::from_slice(&body).map_err(|e| Failure::Garbled(e.to_string()))
    }

    /// Kills the worker (if still alive) and says why the call failed.
    fn post_mortem(mut self, failure: Failure, config: &SandboxConfig) -> ChatError {
        let status = self.stop();
        let mut said = Vec::new();
        let _ = (&mut self.stderr).take(4096).read_to_end(&mut said);
        let said = String::from_utf8_lossy(&said);
        match failure {
            Failure::TimedOut => ChatError::TemplateTimeLimit {
                seconds: config.timeout.as_secs_f64(),
            },
            _ if said.contains("memory allocation of") => ChatError::TemplateMemoryLimit {
                limit_mib: config.memory_bytes >> 20,
            },
            _ if killed_by(status, libc::SIGXCPU) => ChatError::TemplateTimeLimit {
                seconds: config.cpu_seconds as f64,
            },
            Failure::Garbled(what) => {
                ChatError::TemplateRenderer(format!("the worker sent {what}, not a reply"))
            }
            Failure::Died => {
                let status = status.map_or("unknown".to_string(), |s| s.to_string());
                let said = said.lines().next().unwrap_or("").trim();
                ChatError::TemplateRenderer(format!("the worker died ({status}) {said}"))
            }
        }
    }

    fn stop(&mut self) -> Option<ExitStatus> {
        let _ = self.child.kill();
        self.child.wait().ok()
    }
}

fn killed_by(status: Option<ExitStatus>, signal: i32) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.and_then(|s| s.signal()) == Some(signal)
}

/// Fills `buf` from `pipe`, or fails once `deadline` passes.
fn read_until(pipe: &mut ChildStdout, buf: &mut [u8], deadline: Instant) -> Result<(), Failure> {
    let mut filled = 0;
    while filled < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Failure::TimedOut);
        }
        let mut pfd = libc::pollfd {
            fd: pipe.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call; the fd is owned by `pipe`.
        let ready = unsafe { libc::poll(&mut pfd, 1, ms) };
        if ready < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Failure::Died);
        }
        if ready == 0 {
            continue; // the deadline is checked above
        }
        match pipe.read(&mut buf[filled..]) {
            Ok(0) => return Err(Failure::Died),
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return Err(Failure::Died),
        }
    }
    Ok(())
}

/// The worker's side: serves frames from stdin until it closes; returns the exit code.
/// Call it first thing in the worker process (e.g. `afm __template-worker`).
pub fn serve_worker() -> i32 {
    // Replies go through stdout; a caught panic must not write elsewhere.
    std::panic::set_hook(Box::new(|_| {}));
    let mut input = std::io::stdin().lock();
    let mut output = std::io::stdout().lock();
    let mut template: Option<ChatTemplate> = None;
    let mut cpu_seconds = 10;
    loop {
        let frame = match read_frame(&mut input) {
            Ok(Some(f)) => f,
            Ok(None) => return 0,
            Err(_) => return 2,
        };
        let reply = match serde_json::from_slice::<Received>(&frame) {
            Ok(Received::Load(load)) => {
                cpu_seconds = load.cpu_seconds;
                let loaded = bound_memory(load.memory_bytes).and_then(|()| {
                    let limits = RenderLimits {
                        max_output_bytes: load.max_output_bytes,
                        fuel: load.fuel,
                        max_recursion: load.max_recursion,
                    };
                    ChatTemplate::with_limits(&load.source, &load.bos, &load.eos, limits)
                });
                match loaded {
                    Ok(t) => {
                        template = Some(t);
                        Reply::Ok(String::new())
                    }
                    Err(e) => {
                        template = None;
                        Reply::from_result(Err(e))
                    }
                }
            }
            Ok(Received::Render(r)) => match &template {
                Some(t) => {
                    bound_cpu(cpu_seconds);
                    Reply::from_result(t.render(
                        &r.messages,
                        r.tools.as_deref(),
                        r.add_generation_prompt,
                        &r.kwargs,
                    ))
                }
                None => Reply::Template("no template was loaded".into()),
            },
            Err(e) => Reply::Template(format!("bad request to the renderer: {e}")),
        };
        let Ok(bytes) = serde_json::to_vec(&reply) else {
            return 2;
        };
        let Ok(len) = u32::try_from(bytes.len()) else {
            return 2;
        };
        let written = output
            .write_all(&len.to_le_bytes())
            .and_then(|()| output.write_all(&bytes))
            .and_then(|()| output.flush());
        if written.is_err() {
            return 0; // the server is gone
        }
    }
}

/// A length-prefixed frame, or `None` at a clean end of input.
fn read_frame(input: &mut impl Read) -> std::io::Result<Option<Vec<u8>>> {
    let mut head = [0u8; 4];
    match input.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut body = vec![0u8; u32::from_le_bytes(head) as usize];
    input.read_exact(&mut body)?;
    Ok(Some(body))
}

/// RLIMIT_AS for the rest of this process's life, and no core files (an abort past the limit
/// would otherwise write one as large as the limit).
fn bound_memory(bytes: u64) -> Result<(), ChatError> {
    set_limit(libc::RLIMIT_CORE, 0, 0)?;
    if cfg!(target_os = "linux") {
        set_limit(libc::RLIMIT_AS, bytes, bytes)
    } else {
        // Not enforced (or refused) on some Unixes; the CPU and wall-clock limits still hold.
        let _ = set_limit(libc::RLIMIT_AS, bytes, bytes);
        Ok(())
    }
}

/// RLIMIT_CPU counts the process's whole life, so each render gets `seconds` more than
/// used so far (soft limit: SIGXCPU ends the worker).
fn bound_cpu(seconds: u64) {
    // SAFETY: getrusage writes one rusage struct we own.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return;
    }
    let used = (usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) as u64 + 1;
    let _ = set_limit(libc::RLIMIT_CPU, used + seconds, libc::RLIM_INFINITY);
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
type Resource = libc::__rlimit_resource_t;
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
type Resource = libc::c_int;

fn set_limit(resource: Resource, soft: u64, hard: u64) -> Result<(), ChatError> {
    let mut current = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read or write one rlimit struct we own.
    if unsafe { libc::getrlimit(resource, &mut current) } != 0 {
        return Err(ChatError::TemplateRenderer(format!(
            "getrlimit: {}",
            std::io::Error::last_os_error()
        )));
    }
    // A limit can only be lowered: never ask for more than the hard limit in place.
    let hard = hard.min(current.rlim_max);
    let wanted = libc::rlimit {
        rlim_cur: soft.min(hard),
        rlim_max: hard,
    };
    if unsafe { libc::setrlimit(resource, &wanted) } != 0 {
        return Err(ChatError::TemplateRenderer(format!(
            "setrlimit: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}
