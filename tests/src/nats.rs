//! A real `nats-server` (with JetStream) for the replica tests: started on a port from below
//! the ephemeral range ([`crate::ports`]), so it can be killed and started again on the same
//! port, and frozen (SIGSTOP) to hold it silent. Ended by its pid, never by name.

use crate::cluster::TempDir;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `nats-server` process of this test's.
pub struct NatsServer {
    child: Option<Child>,
    /// Its client port.
    pub port: u16,
    dir: TempDir,
}

impl NatsServer {
    /// Starts one, with JetStream storing under a fresh directory; panics with the reason when
    /// `nats-server` is not installed (`.ci/run` installs Debian's).
    pub fn start() -> Self {
        let port = crate::ports::reserved_run(1);
        let mut s = Self { child: None, port, dir: TempDir::new() };
        s.spawn();
        s
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills it (SIGKILL) and waits for it to be gone.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port and store.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Freezes it (SIGSTOP): connections stay open and nothing is answered.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Lets a frozen server run again (SIGCONT).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        let ok = Command::new("kill").args([sig, &pid]).status().is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {pid}");
    }

    fn spawn(&mut self) {
        let store = self.dir.0.join("js");
        let log = self.dir.0.join("nats.log");
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"])
            .arg(&store)
            .arg("-l")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("nats-server: {e} (install Debian's nats-server package; .ci/run does)"));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not listen on {}: {}", self.port, std::fs::read_to_string(&log).unwrap_or_default());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        // SIGKILL ends a frozen process too.
        self.kill();
    }
}
