//! The `local` connector: worker processes on this machine, started from the command template
//! by `sh -c` in a process group of their own (so a stop reaches the engine processes a vLLM
//! server forks, and nothing else), with ports from a range and GPUs from a pool.
//!
//! The running workers are written to `state_file` after every change; a gateway that starts
//! with that file adopts the workers still alive (same pid, its command line naming its port)
//! instead of starting new ones. Without a state file, the workers are stopped with the
//! gateway.

use super::output::Output;
use super::{Connector, ConnectorError, Managed};
use crate::config::{LocalConnector, UpstreamUrl};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

/// Ports tried past `ports_from` before giving up.
const PORT_SPAN: u16 = 1000;

/// One started worker.
struct Proc {
    saved: Saved,
    /// Our child, when we started it (an adopted worker is not).
    child: Option<tokio::process::Child>,
    /// Where its output can be read back.
    output: Output,
}

/// A worker that exited on its own: how, and its last lines.
struct Exited {
    name: String,
    how: String,
    /// Read when asked: its pipes may still be read a moment after it exited.
    output: Output,
}

/// Exits remembered for [`Connector::last_words`].
const EXITS_KEPT: usize = 16;

/// A worker as the state file records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Saved {
    name: String,
    port: u16,
    kv_port: u16,
    gpus: Vec<u32>,
    /// Its pid, which is also its process group's id.
    pid: i32,
    /// Its start time (`/proc/<pid>/stat` field 22, clock ticks since boot): a pid reused by
    /// another process has another, so that one is never adopted. 0: not known.
    #[serde(default)]
    started: u64,
}

/// The `local` connector.
pub struct Local {
    cfg: LocalConnector,
    model: String,
    gpus_per_worker: u32,
    procs: Mutex<Vec<Proc>>,
    /// The latest workers that exited on their own, newest last.
    exited: Mutex<VecDeque<Exited>>,
}

impl Local {
    /// A connector for `model`, adopting the live workers its state file lists.
    pub fn new(cfg: LocalConnector, model: &str, gpus_per_worker: u32) -> Self {
        let adopted = cfg.state_file.as_deref().map(adopt).unwrap_or_default();
        for s in &adopted {
            tracing::info!(model, worker = %s.name, pid = s.pid, port = s.port, "planner: adopted a running worker from the state file");
        }
        // An adopted worker's output is where the gateway that started it sent it.
        let output = |s: &Saved| log_path(&cfg, &s.name).map_or(Output::Lost, Output::File);
        let procs: Vec<Proc> = adopted.into_iter().map(|saved| Proc { output: output(&saved), saved, child: None }).collect();
        let me = Self { cfg, model: model.to_string(), gpus_per_worker, procs: Mutex::new(procs), exited: Mutex::new(VecDeque::new()) };
        me.save();
        me
    }

    fn managed(&self, s: &Saved) -> Managed {
        let url = UpstreamUrl::parse(&format!("http://{}:{}", self.cfg.host, s.port)).expect("host checked by the config");
        Managed { name: s.name.clone(), url, gpus: s.gpus.clone(), kv_events: self.cfg.kv_events, origin: crate::config::Origin::Planner(s.name.clone()) }
    }

    /// The lowest port pair free in the range and on the machine, and GPUs from the pool.
    fn claim(&self, procs: &[Proc]) -> Result<(u16, u16, Vec<u32>), ConnectorError> {
        let taken_gpus: Vec<u32> = procs.iter().flat_map(|p| p.saved.gpus.iter().copied()).collect();
        let gpus: Vec<u32> = self.cfg.gpus.iter().copied().filter(|g| !taken_gpus.contains(g)).take(self.gpus_per_worker as usize).collect();
        if !self.cfg.gpus.is_empty() && gpus.len() < self.gpus_per_worker as usize {
            return Err(ConnectorError::Exhausted(format!("{} of the {} GPUs in the pool are in use", taken_gpus.len(), self.cfg.gpus.len())));
        }
        let bindable = |port: u16| std::net::TcpListener::bind((self.cfg.host.as_str(), port)).is_ok();
        let end = self.cfg.ports_from.saturating_add(PORT_SPAN);
        (self.cfg.ports_from..end)
            .map(|p| (p, self.cfg.kv_port(p)))
            .find(|&(p, k)| !procs.iter().any(|q| q.saved.port == p) && bindable(p) && (!self.cfg.kv_events || bindable(k)))
            .map(|(p, k)| (p, k, gpus))
            .ok_or_else(|| ConnectorError::Exhausted(format!("no free port in {}..{end}", self.cfg.ports_from)))
    }

    /// The command for one worker, placeholders replaced.
    fn render(&self, s: &Saved) -> String {
        let gpus: Vec<String> = s.gpus.iter().map(u32::to_string).collect();
        self.cfg
            .command
            .replace("{port}", &s.port.to_string())
            .replace("{kv_port}", &s.kv_port.to_string())
            .replace("{gpu}", &gpus.join(","))
            .replace("{name}", &s.name)
            .replace("{model}", &self.model)
    }

    /// Starts `s`'s process, its output to its log file, else kept from its pipes when it stops
    /// with the gateway (no state file), else dropped.
    fn spawn(&self, s: &Saved) -> std::io::Result<(tokio::process::Child, Output)> {
        let mut cmd = tokio::process::Command::new("sh");
        // exec: the worker itself is the group's leader, so its exit is what we wait for.
        cmd.arg("-c").arg(format!("exec {}", self.render(s))).process_group(0).stdin(Stdio::null());
        let piped = self.cfg.log_dir.is_none() && self.cfg.state_file.is_none();
        let log = log_path(&self.cfg, &s.name);
        if let Some(path) = &log {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let file = std::fs::File::create(path)?;
            cmd.stdout(file.try_clone()?).stderr(file);
        } else if piped {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        } else {
            cmd.stdout(Stdio::null()).stderr(Stdio::null());
        }
        if !s.gpus.is_empty() {
            let gpus: Vec<String> = s.gpus.iter().map(u32::to_string).collect();
            cmd.env("CUDA_VISIBLE_DEVICES", gpus.join(","));
        }
        let mut child = cmd.spawn()?;
        let output = match log {
            Some(path) => Output::File(path),
            None if piped => Output::keep(child.stdout.take(), child.stderr.take()),
            None => Output::Lost,
        };
        Ok((child, output))
    }

    /// Remembers that `p` exited on its own.
    fn remember_exit(&self, p: &mut Proc) {
        let how = match p.child.as_mut().map(tokio::process::Child::try_wait) {
            Some(Ok(Some(status))) => status.to_string(),
            _ => "exited".to_string(),
        };
        let mut exited = self.exited.lock();
        if exited.len() == EXITS_KEPT {
            exited.pop_front();
        }
        exited.push_back(Exited { name: p.saved.name.clone(), how, output: p.output.clone() });
    }

    /// Writes the running workers to the state file (atomically: a crash mid-write leaves the
    /// previous list).
    fn save(&self) {
        let Some(path) = &self.cfg.state_file else { return };
        let list: Vec<Saved> = self.procs.lock().iter().map(|p| p.saved.clone()).collect();
        let tmp = path.with_extension("tmp");
        let r =
            serde_json::to_vec_pretty(&list).map_err(std::io::Error::other).and_then(|b| std::fs::write(&tmp, b)).and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = r {
            tracing::error!(path = %path.display(), error = %e, "planner: cannot write the local connector's state file");
        }
    }
}

/// The workers of a state file still running: the pid alive and its command line naming the
/// recorded port (a pid reused by another process is not adopted).
fn adopt(path: &Path) -> Vec<Saved> {
    let Ok(text) = std::fs::read(path) else { return Vec::new() };
    let list: Vec<Saved> = match serde_json::from_slice(&text) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "planner: the state file is unreadable; no worker adopted");
            return Vec::new();
        }
    };
    list.into_iter()
        .filter(|s| {
            let cmdline = std::fs::read(format!("/proc/{}/cmdline", s.pid)).unwrap_or_default();
            let port = s.port.to_string();
            let same = s.started == 0 || start_time(s.pid) == Some(s.started);
            alive(s.pid) && same && cmdline.split(|&b| b == 0 || b == b'=' || b == b' ').any(|arg| arg == port.as_bytes())
        })
        .collect()
}

/// `/proc/<pid>/stat`'s fields from the state on (field 3: the ones after the command name's
/// closing parenthesis, as the name may hold spaces).
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(stat.rsplit_once(')')?.1.split_whitespace().map(str::to_string).collect())
}

/// A process's start time, in clock ticks since boot (field 22).
fn start_time(pid: i32) -> Option<u64> {
    stat_fields(pid)?.get(19)?.parse().ok()
}

/// Running: it exists and is not a zombie (one that exited but was not waited for by its
/// parent is as good as gone).
fn alive(pid: i32) -> bool {
    if pid <= 1 {
        return false;
    }
    let zombie = stat_fields(pid).is_some_and(|f| f.first().is_some_and(|state| state == "Z"));
    kill(Pid::from_raw(pid), None).is_ok() && !zombie
}

/// Signals a worker's whole process group (gone already: nothing to do).
fn signal_group(pid: i32, sig: Signal) {
    // 0 would be our own group, 1 init's: never ours to signal.
    if pid > 1 {
        let _ = killpg(Pid::from_raw(pid), sig);
    }
}

#[async_trait::async_trait]
impl Connector for Local {
    fn kind(&self) -> &'static str {
        "local"
    }

    async fn add(&self) -> Result<Managed, ConnectorError> {
        let mut procs = self.procs.lock();
        let (port, kv_port, gpus) = self.claim(&procs)?;
        let mut saved = Saved { name: format!("{}-{port}", sanitize(&self.model)), port, kv_port, gpus, pid: 0, started: 0 };
        let (child, output) = self.spawn(&saved).map_err(ConnectorError::Start)?;
        saved.pid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
        saved.started = start_time(saved.pid).unwrap_or(0);
        tracing::info!(model = %self.model, worker = %saved.name, pid = saved.pid, command = %self.render(&saved), "planner: worker started");
        let m = self.managed(&saved);
        procs.push(Proc { saved, child: Some(child), output });
        drop(procs);
        self.save();
        Ok(m)
    }

    async fn remove(&self, name: &str) -> Result<(), ConnectorError> {
        let p = {
            let mut procs = self.procs.lock();
            let i = procs.iter().position(|p| p.saved.name == name).ok_or_else(|| ConnectorError::Unknown(name.to_string()))?;
            procs.remove(i)
        };
        self.save();
        let Proc { saved, child, .. } = p;
        signal_group(saved.pid, Signal::SIGTERM);
        let grace = Duration::from_secs_f64(self.cfg.stop_timeout_s);
        let exited = match child {
            Some(mut c) => tokio::time::timeout(grace, c.wait()).await.is_ok(),
            None => {
                let deadline = tokio::time::Instant::now() + grace;
                while alive(saved.pid) && tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                !alive(saved.pid)
            }
        };
        if !exited {
            tracing::warn!(model = %self.model, worker = %saved.name, "planner: the worker outlived stop_timeout_s after SIGTERM; killed");
        }
        // Whatever of its group is left (engine processes a killed server left behind).
        signal_group(saved.pid, Signal::SIGKILL);
        tracing::info!(model = %self.model, worker = %saved.name, "planner: worker stopped");
        Ok(())
    }

    fn list(&self) -> Vec<Managed> {
        self.procs.lock().iter().map(|p| self.managed(&p.saved)).collect()
    }

    fn reap(&self) -> Vec<Managed> {
        let mut gone = Vec::new();
        self.procs.lock().retain_mut(|p| {
            let exited = match &mut p.child {
                Some(c) => !matches!(c.try_wait(), Ok(None)),
                None => !alive(p.saved.pid),
            };
            if exited {
                signal_group(p.saved.pid, Signal::SIGKILL);
                self.remember_exit(p);
                gone.push(p.saved.clone());
            }
            !exited
        });
        if !gone.is_empty() {
            self.save();
        }
        gone.iter().map(|s| self.managed(s)).collect()
    }

    fn ready_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.cfg.ready_timeout_s)
    }

    fn last_words(&self, name: &str) -> Option<String> {
        // Read outside the lock: a log file's tail is a read of the disk.
        let (how, output) = self.exited.lock().iter().rev().find(|e| e.name == name).map(|e| (e.how.clone(), e.output.clone()))?;
        let last = output.last_lines();
        let lines = if last.is_empty() {
            match &self.cfg.log_dir {
                None if self.cfg.state_file.is_some() => "; its output was not kept (set log_dir to keep it)".to_string(),
                _ => "; it wrote nothing".to_string(),
            }
        } else {
            format!("; its last lines:\n{}", last.join("\n"))
        };
        Some(format!("{how}{lines}"))
    }
}

impl Drop for Local {
    /// Without a state file no later gateway could adopt them: they stop with this one.
    fn drop(&mut self) {
        if self.cfg.state_file.is_none() {
            for p in self.procs.lock().iter() {
                signal_group(p.saved.pid, Signal::SIGTERM);
            }
        }
    }
}

/// Worker `name`'s log file, when workers keep logs (`log_dir`).
fn log_path(cfg: &LocalConnector, name: &str) -> Option<std::path::PathBuf> {
    cfg.log_dir.as_ref().map(|d| d.join(format!("{name}.log")))
}

/// A model name as a worker name: letters, digits, `-` and `_`; anything else becomes `_`.
fn sanitize(model: &str) -> String {
    model.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory, removed at drop.
    struct TestDir(std::path::PathBuf);
    impl TestDir {
        fn path(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for TestDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn connector(command: &str, extra: &str) -> (Local, TestDir) {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = TestDir(std::env::temp_dir().join(format!("kvgate-local-{}-{n}", std::process::id())));
        std::fs::create_dir_all(dir.path()).unwrap();
        let state = dir.path().join("state.json");
        let yaml = format!("{{command: '{command}', ports_from: 21000, state_file: {}, {extra}}}", state.display());
        let cfg: LocalConnector = serde_yaml::from_str(&yaml).unwrap();
        (Local::new(cfg, "org/model", 1), dir)
    }

    /// Reaps `c` until a worker is gone.
    async fn reaped(c: &Local) -> Vec<Managed> {
        for _ in 0..200 {
            let gone = c.reap();
            if !gone.is_empty() {
                return gone;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Vec::new()
    }

    #[tokio::test]
    async fn a_worker_that_exits_at_once_leaves_its_last_lines_and_exit_status() {
        // Without a state file nor a log folder: its output is kept from its pipes.
        let cfg: LocalConnector =
            serde_yaml::from_str("{command: \"sh -c 'echo starting {port}; echo no such model >&2; exit 3'\", ports_from: 21500}").unwrap();
        let c = Local::new(cfg, "m", 1);
        let w = c.add().await.unwrap();
        assert_eq!(reaped(&c).await, vec![w.clone()]);
        // Its pipes may still be read a moment after its exit.
        let mut words = String::new();
        for _ in 0..100 {
            words = c.last_words(&w.name).unwrap();
            if words.contains("no such model") && words.contains("starting") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(words.contains("exit status: 3") && words.contains("starting 2150") && words.contains("no such model"), "{words}");
        assert_eq!(c.last_words("another"), None);
        // With a log folder, the lines are read back from its log.
        let dir = std::env::temp_dir().join(format!("kvgate-local-words-{}", std::process::id()));
        let yaml = format!("{{command: \"sh -c 'echo cannot bind; exit 1'\", ports_from: 21600, log_dir: {}}}", dir.display());
        let c = Local::new(serde_yaml::from_str(&yaml).unwrap(), "m", 1);
        let w = c.add().await.unwrap();
        assert_eq!(reaped(&c).await, vec![w.clone()]);
        let words = c.last_words(&w.name).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(words.contains("exit status: 1") && words.contains("cannot bind"), "{words}");
    }

    #[test]
    fn the_template_gets_every_placeholder() {
        let (c, _d) = connector("srv --port {port} --kv {kv_port} --gpu {gpu} --name {name} --model {model}", "gpus: [3, 5]");
        let s = Saved { name: "org_model-8100".into(), port: 8100, kv_port: 9100, gpus: vec![3], pid: 0, started: 0 };
        assert_eq!(c.render(&s), "srv --port 8100 --kv 9100 --gpu 3 --name org_model-8100 --model org/model");
    }

    #[tokio::test]
    async fn workers_start_in_their_own_group_are_reaped_when_they_die_and_stop_on_remove() {
        // `sleep` (its port one more argument, as GNU sleep adds them up) stands in for a server: the connector does not talk HTTP (the planner does).
        let (c, dir) = connector("sleep 300 {port}", "gpus: [0, 1], stop_timeout_s: 5");
        let a = c.add().await.unwrap();
        let b = c.add().await.unwrap();
        assert_ne!(a.url, b.url, "each takes its own port");
        assert_eq!((a.gpus.clone(), b.gpus.clone()), (vec![0], vec![1]));
        assert!(matches!(c.add().await, Err(ConnectorError::Exhausted(_))), "the GPU pool is empty");
        let saved: Vec<Saved> = serde_json::from_slice(&std::fs::read(dir.path().join("state.json")).unwrap()).unwrap();
        assert_eq!(saved.len(), 2);
        // One dies on its own: reaped once, its GPU back in the pool.
        signal_group(saved[1].pid, Signal::SIGKILL);
        let mut reaped = Vec::new();
        for _ in 0..100 {
            reaped = c.reap();
            if !reaped.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(reaped, vec![b.clone()]);
        assert!(c.reap().is_empty(), "reported once");
        assert_eq!(c.add().await.unwrap().gpus, vec![1]);
        // A stop is SIGTERM to the group; the process is gone when remove returns.
        c.remove(&a.name).await.unwrap();
        assert!(!alive(saved[0].pid));
        assert!(matches!(c.remove(&a.name).await, Err(ConnectorError::Unknown(_))));
        assert_eq!(c.list().len(), 1);
    }

    #[tokio::test]
    async fn a_restarted_gateway_adopts_the_workers_of_its_state_file() {
        let (c, dir) = connector("sleep 300 {port}", "");
        let a = c.add().await.unwrap();
        let cfg = c.cfg.clone();
        // A gateway restarts long after its workers started: let this one finish its exec (its
        // command line is briefly empty while the shell becomes `sleep`).
        let pid = c.procs.lock()[0].saved.pid;
        for _ in 0..500 {
            if std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default().starts_with(b"sleep") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The gateway goes away without stopping it (a state file keeps workers running)...
        std::mem::forget(c);
        // ...and the next one finds it.
        let again = Local::new(cfg.clone(), "org/model", 1);
        assert_eq!(again.list(), vec![a.clone()]);
        again.remove(&a.name).await.unwrap();
        let after = Local::new(cfg, "org/model", 1);
        assert!(after.list().is_empty(), "a stopped worker is not adopted");
        drop(dir);
    }
}
