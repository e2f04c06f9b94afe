//! The `afm` binary: parses the command line, loads the model, then serves the OpenAI API or
//! answers one `-s` prompt. Every failure is one line on stderr and exit code 1.

mod bench;
mod browser;
mod cli;
mod load;
mod single;

use std::process::ExitCode;
use std::sync::Arc;

use afm_server::tool_calls::ToolCallConfig;
use afm_server::{AppState, ServerConfig};
use anyhow::{Context, Result};
use clap::Parser;

use cli::{Cli, Command, ServeArgs};

fn main() -> ExitCode {
    // Hidden: a sandboxed chat-template renderer, started by the server itself (load.rs).
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == load::TEMPLATE_WORKER_ARG)
    {
        return ExitCode::from(afm_chat::template::serve_worker().clamp(0, 255) as u8);
    }
    std::panic::set_hook(Box::new(|info| {
        eprintln!(
            "afm: internal error: {}",
            info.to_string().replace('\n', " ")
        );
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            let _ = e.print(); // --help, --version
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let text = e.to_string();
            eprintln!(
                "afm: {}",
                text.lines().next().unwrap_or("invalid arguments")
            );
            return ExitCode::FAILURE;
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("afm: error: {}", format!("{e:#}").replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    let args = match cli.command {
        Command::Serve(args) => args,
        Command::Bench(args) => return bench::run(&args),
    };
    args.refuse_unavailable()?;
    let config = ServerConfig {
        defaults: args.request_defaults()?,
        raw: args.raw,
        log_requests: args.log_level() >= 1,
        tool_calls: ToolCallConfig {
            format: args.tool_call_parser,
            fix_args: args.fix_tool_args,
            debug: std::env::var("AFM_DEBUG").is_ok_and(|v| v == "1"),
        },
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        cors_origins: args.cors_origin.clone(),
        limits: args.limits.limits(),
        ..ServerConfig::default()
    };
    let (served, engine) = load::load(&args)?;
    let state = AppState::new(served, config);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let done = runtime.block_on(async {
        match &args.single_prompt {
            Some(prompt) => single::run(&args, state, prompt).await,
            None => serve(&args, state).await,
        }
    });
    drop(runtime);
    engine.shutdown();
    done
}

async fn serve(args: &ServeArgs, state: Arc<AppState>) -> Result<()> {
    let addr = format!("{}:{}", args.hostname, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    eprintln!(
        "afm: serving {} at http://{addr}/v1 (context {} tokens)",
        state.model.info.id,
        state.model.generator.max_context()
    );
    if args.webui {
        browser::open_webui(listener.local_addr().context("reading the bound address")?);
    }
    // SIGINT or SIGTERM: stop accepting, let in-flight answers finish for --shutdown-timeout,
    // cancel the rest.
    let shutdown = async {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term => {}
        }
        eprintln!("afm: shutting down");
    };
    afm_server::serve(listener, state, shutdown)
        .await
        .context("serving")
}
