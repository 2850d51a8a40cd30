//! A minimal WebDriver client (the W3C protocol, JSON over HTTP/1.1) that
//! drives headless Chromium through `chromedriver` for the browser tests
//! that click: a session, a page, elements found by CSS selector, clicks,
//! typed text, and scripts that read the page.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The W3C element reference key.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A browser session; the driver and the browser end when it is dropped.
pub struct Driver {
    port: u16,
    child: Child,
    session: String,
    _profile: tempfile::TempDir,
}

fn chromedriver() -> &'static str {
    let found = Command::new("chromedriver")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "chromedriver is not installed: `apt-get install chromium-driver` (or run .ci/services)"
    );
    "chromedriver"
}

impl Driver {
    /// Starts `chromedriver` and a headless Chromium session (no host but
    /// loopback resolves, as in the other browser tests).
    pub fn start() -> Driver {
        let port = crate::support::free_port();
        let child = Command::new(chromedriver())
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let profile = tempfile::tempdir().unwrap();
        let mut driver = Driver {
            port,
            child,
            session: String::new(),
            _profile: profile,
        };
        let up = Instant::now();
        while driver.call("GET", "/status", None)["value"]["ready"] != true {
            assert!(
                up.elapsed() < Duration::from_secs(15),
                "chromedriver did not start"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                    format!("--user-data-dir={}", driver._profile.path().display()),
                ]
            }
        }}});
        let made = driver.call("POST", "/session", Some(caps));
        driver.session = made["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {made}"))
            .to_string();
        driver
    }

    /// One WebDriver command: its answer's JSON.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return Value::Null;
        };
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let _ = write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        // chromedriver keeps the connection open: read the head, then as
        // many bytes as it says the body has.
        let mut bytes = Vec::new();
        let mut chunk = [0u8; 8192];
        let body_at = loop {
            if let Some(at) = bytes.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            match s.read(&mut chunk) {
                Ok(0) | Err(_) => return Value::Null,
                Ok(n) => bytes.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&bytes[..body_at]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while bytes.len() < body_at + length {
            match s.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => bytes.extend_from_slice(&chunk[..n]),
            }
        }
        serde_json::from_slice(&bytes[body_at..]).unwrap_or(Value::Null)
    }

    fn session_call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let answer = self.call(method, &format!("/session/{}{path}", self.session), body);
        assert!(
            answer.is_object() && answer["value"]["error"].is_null(),
            "{method} {path}: {answer}"
        );
        answer["value"].clone()
    }

    pub fn goto(&self, url: &str) {
        self.session_call("POST", "/url", Some(json!({"url": url})));
    }

    /// The element `css` selects (the first), if any.
    pub fn find(&self, css: &str) -> Option<String> {
        let answer = self.call(
            "POST",
            &format!("/session/{}/element", self.session),
            Some(json!({"using": "css selector", "value": css})),
        );
        answer["value"][ELEMENT].as_str().map(str::to_string)
    }

    fn element(&self, css: &str) -> String {
        self.find(css).unwrap_or_else(|| {
            panic!(
                "no element {css}: {}",
                self.script("return document.body.outerHTML")
            )
        })
    }

    /// Clicks what `css` selects, as a user does. The page redraws its
    /// tables every 2 s: an element replaced between the look and the click
    /// is looked for again.
    pub fn click(&self, css: &str) {
        for _ in 0..5 {
            let id = self.element(css);
            let answer = self.call(
                "POST",
                &format!("/session/{}/element/{id}/click", self.session),
                Some(json!({})),
            );
            match answer["value"]["error"].as_str() {
                None => return,
                Some("stale element reference") => continue,
                Some(_) => panic!("click {css}: {answer}"),
            }
        }
        panic!("click {css}: the element kept being replaced");
    }

    /// Types `text` into the field `css` selects.
    pub fn type_into(&self, css: &str, text: &str) {
        let id = self.element(css);
        self.session_call(
            "POST",
            &format!("/element/{id}/value"),
            Some(json!({"text": text})),
        );
    }

    /// Runs `js` (a function body) in the page: what it returns.
    pub fn script(&self, js: &str) -> Value {
        self.session_call(
            "POST",
            "/execute/sync",
            Some(json!({"script": js, "args": []})),
        )
    }

    /// The text of what `css` selects ("" when nothing).
    pub fn text(&self, css: &str) -> String {
        let js = format!(
            "const e = document.querySelector({}); return e ? e.textContent : '';",
            json!(css)
        );
        self.script(&js).as_str().unwrap_or_default().to_string()
    }

    /// Waits up to `within` for `what` of the page to hold.
    pub fn wait_for<T>(
        &self,
        what: &str,
        within: Duration,
        mut f: impl FnMut(&Driver) -> Option<T>,
    ) -> T {
        let start = Instant::now();
        loop {
            if let Some(v) = f(self) {
                return v;
            }
            assert!(
                start.elapsed() < within,
                "timed out waiting for {what}: {}",
                self.script("return document.body.outerHTML")
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = self.call("DELETE", &format!("/session/{}", self.session), None);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
