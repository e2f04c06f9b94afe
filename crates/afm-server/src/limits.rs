//! What one client may take from the server: connections (`--max-connections`), time to send
//! the request head and body (slowloris), time to take the answer (`--write-timeout`: a client
//! that stops reading), a per-request deadline (`--request-timeout`), the number of chat
//! messages, and how long shutdown waits for in-flight answers.
//!
//! It owns the accept loop, because axum's `serve` exposes neither a connection cap nor a
//! header-read timeout. It does not own the body-size limit (routes) or the queue limit
//! (`--max-waiting`, the engine).

use std::future::Future;
use std::io;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use afm_api::ApiError;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use futures::stream::{self, BoxStream, Stream, StreamExt};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Sleep;

use crate::chat::{done_event, json_event};
use crate::routes::HttpError;
use crate::AppState;

/// Every limit has a flag in `afm serve`; these are its defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Open connections at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Time to send a complete request head (idle keep-alive connections included).
    pub header_timeout: Duration,
    /// Time to send the whole request body once the head is in.
    pub body_timeout: Duration,
    /// A connection whose writes make no progress for this long (the client stopped reading)
    /// is closed, which cancels its requests and frees their KV blocks.
    pub write_timeout: Duration,
    /// A request still running after this is cancelled and answered with a timeout error
    /// (408 JSON, or an SSE error event before `[DONE]`).
    pub request_timeout: Option<Duration>,
    /// Messages in one chat request.
    pub max_messages: usize,
    /// After SIGINT/SIGTERM, how long in-flight requests may still run before they are cancelled.
    pub shutdown_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 512,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(60),
            request_timeout: Some(Duration::from_secs(1800)),
            max_messages: 4096,
            shutdown_timeout: Duration::from_secs(10),
        }
    }
}

/// Refuses a chat request with more than `max_messages` messages, before any of them is parsed.
pub fn check_messages(count: usize, limits: &Limits) -> Result<(), ApiError> {
    if count > limits.max_messages {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "{count} messages given; the limit is {} (--max-messages)",
                limits.max_messages
            ),
        ));
    }
    Ok(())
}

/// The error of a request that outlived `--request-timeout`.
fn deadline_error(after: Duration) -> ApiError {
    ApiError::Timeout(format!(
        "The request did not finish within {} s (--request-timeout) and was cancelled",
        after.as_secs_f64()
    ))
}

/// Runs a non-streamed answer within `--request-timeout`; past it the answer is dropped (which
/// cancels its engine requests) and the client gets a 408 timeout error.
pub async fn within_deadline<T>(
    after: Option<Duration>,
    answer: impl Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    match after {
        Some(after) => tokio::time::timeout(after, answer)
            .await
            .unwrap_or_else(|_| Err(deadline_error(after))),
        None => answer.await,
    }
}

/// A streamed answer within `--request-timeout`: its events until the deadline, then an
/// OpenAI error event (`{"error": {..., "code": "timeout"}}`) and `[DONE]`. The answer's
/// stream is dropped at the deadline, which cancels its engine requests.
pub fn sse_within_deadline(
    events: impl Stream<Item = Result<Event, Infallible>> + Send + 'static,
    after: Option<Duration>,
) -> BoxStream<'static, Result<Event, Infallible>> {
    let Some(after) = after else {
        return events.boxed();
    };
    let deadline = Box::pin(tokio::time::sleep(after));
    stream::unfold(Some((events.boxed(), deadline)), move |state| async move {
        let (mut events, mut deadline) = state?;
        tokio::select! {
            // The deadline first: a fast generation must not starve it.
            biased;
            _ = deadline.as_mut() => {
                drop(events);
                let timed_out = json_event(&deadline_error(after).body());
                Some((vec![Ok(timed_out), Ok(done_event())], None))
            }
            event = events.next() => event.map(|e| (vec![e], Some((events, deadline)))),
        }
    })
    .flat_map(stream::iter)
    .boxed()
}

/// Middleware: reads the body within `body_timeout` (408 after it) and at most
/// `max_body_bytes` (413), so a client trickling bytes cannot hold a handler forever.
pub async fn read_body_in_time(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let (parts, body) = req.into_parts();
    let limit = state.config.max_body_bytes;
    let timeout = state.config.limits.body_timeout;
    let collected = tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await;
    match collected {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            let err = if too_large {
                ApiError::BodyTooLarge { limit }
            } else {
                ApiError::InvalidJson {
                    param: None,
                    message: format!("The request body could not be read: {e}"),
                }
            };
            HttpError(err).into_response()
        }
        Err(_) => HttpError(ApiError::Timeout(format!(
            "The request body did not arrive within {} s",
            timeout.as_secs_f64()
        )))
        .into_response(),
    }
}

/// Serves `state` on `listener` until `shutdown` resolves, then stops accepting, lets open
/// requests finish for up to `shutdown_timeout` and returns (dropping, hence cancelling, the
/// rest).
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let limits = state.config.limits.clone();
    let app = crate::router(state);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    loop {
        while conns.try_join_next().is_some() {}
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors and the like: wait, do not spin or die.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            tokio::spawn(refuse(stream, limits.max_connections));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let io = TokioIo::new(Permitted {
            stream,
            _permit: permit,
            write_timeout: limits.write_timeout,
            stalled: None,
        });
        let mut stop = stop_rx.clone();
        let header_timeout = limits.header_timeout;
        conns.spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(io, service)
                .with_upgrades();
            let mut conn = pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = stop.wait_for(|s| *s) => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(limits.shutdown_timeout, async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        eprintln!(
            "afm: {} connection(s) still open after {} s (--shutdown-timeout); cancelling them",
            conns.len(),
            limits.shutdown_timeout.as_secs_f64()
        );
        // Dropping a connection drops its generation, which cancels the engine requests.
        conns.abort_all();
        while conns.join_next().await.is_some() {}
    }
    Ok(())
}

/// Answers a connection over the cap with 503 and OpenAI error JSON, then closes it. Reads the
/// request head first (briefly) so the client sees the answer rather than a reset.
async fn refuse(mut stream: TcpStream, limit: usize) {
    let err = ApiError::Overloaded { limit };
    let body = serde_json::to_string(&err.body()).unwrap_or_default();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let mut buf = [0u8; 8192];
    let mut seen = Vec::new();
    let _ = tokio::time::timeout(Duration::from_millis(500), async {
        while let Ok(n @ 1..) = stream.read(&mut buf).await {
            seen.extend_from_slice(&buf[..n]);
            if seen.windows(4).any(|w| w == b"\r\n\r\n") || seen.len() > 65536 {
                break;
            }
        }
    })
    .await;
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
}

/// A connection that gives its slot back when it closes, and fails its writes once they
/// have made no progress for `write_timeout` (hyper then closes it).
struct Permitted {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
    write_timeout: Duration,
    /// Since when writes have been blocked (the client's receive window is full).
    stalled: Option<Pin<Box<Sleep>>>,
}

impl Permitted {
    /// `polled` is a write's outcome: progress clears the stall timer; a blocked write starts
    /// it, and once it runs out the write fails with `TimedOut`.
    fn bounded<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let timeout = self.write_timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the client took nothing for {} s (--write-timeout)",
                    timeout.as_secs_f64()
                ),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for Permitted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Permitted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.bounded(cx, polled)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.bounded(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_count_is_checked_against_the_flag() {
        let limits = Limits {
            max_messages: 3,
            ..Limits::default()
        };
        assert!(check_messages(3, &limits).is_ok());
        let err = check_messages(4, &limits).unwrap_err();
        assert_eq!(err.status(), 400);
        assert!(err.to_string().contains("4 messages") && err.to_string().contains("limit is 3"));
    }
}
