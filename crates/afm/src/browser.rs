//! `-w`: prints the built-in chat page's URL and opens it in the user's browser through the
//! desktop's opener (`xdg-open`, or `open` on macOS) when there is one. A missing opener (a
//! server with no desktop) is not an error: the printed URL is enough.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::process::{Command, Stdio};

pub fn open_webui(bound: SocketAddr) {
    let url = webui_url(bound);
    eprintln!("afm: WebUI at {url}");
    let opener = if cfg!(target_os = "macos") {
        "open"
    } else {
        "xdg-open"
    };
    let spawned = Command::new(opener)
        .arg(&url)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    match spawned {
        // Reaped on a side thread so the server never waits on the browser.
        Ok(mut child) => drop(std::thread::spawn(move || child.wait())),
        Err(_) => eprintln!("afm: no browser opener ({opener}) found; open the URL above"),
    }
}

/// A wildcard bind address (0.0.0.0, ::) is not a place to browse to: use loopback.
fn webui_url(bound: SocketAddr) -> String {
    let ip = match bound.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}/", SocketAddr::new(ip, bound.port()))
}

#[cfg(test)]
mod tests {
    use super::webui_url;

    #[test]
    fn url_points_at_the_bound_port_and_a_browsable_host() {
        let url = |a: &str| webui_url(a.parse().unwrap());
        assert_eq!(url("127.0.0.1:9999"), "http://127.0.0.1:9999/");
        assert_eq!(url("0.0.0.0:8080"), "http://127.0.0.1:8080/");
        assert_eq!(url("[::]:8080"), "http://[::1]:8080/");
        assert_eq!(url("192.168.1.5:80"), "http://192.168.1.5:80/");
    }
}
