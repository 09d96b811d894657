//! The `kvgate` binary's command line: `check` exit codes and error locations.

use std::process::Command;

fn kvgate(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvgate")).args(args).env_remove("KVGATE_LISTEN").output().expect("kvgate runs");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn check_accepts_the_reference_config() {
    let reference = concat!(env!("CARGO_MANIFEST_DIR"), "/../conf/kvgate.yaml");
    let (code, out, err) = kvgate(&["check", "--config", reference]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("ok"), "{out}");
}

#[test]
fn check_rejects_with_file_line_and_column() {
    let dir = std::env::temp_dir().join(format!("kvgate-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "models:\n  - name: m\n    workers:\n      - url: http://h:1\n        weight: 3\n").unwrap();
    let (code, _, err) = kvgate(&["check", "--config", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("bad.yaml:5:9:") && err.contains("unknown field `weight`"), "{err}");
    let plugin = dir.join("plugin.yaml");
    std::fs::write(&plugin, "plugins:\n  - name: p\n    path: /nonexistent/p.wasm\nmodels:\n  - name: m\n    routing: {mode: plugin, plugin: p}\n    workers:\n      - url: http://h:1\n").unwrap();
    let (code, _, err) = kvgate(&["check", "--config", plugin.to_str().unwrap()]);
    assert_eq!(code, 1, "a plugin that does not load fails the check");
    assert!(err.contains("plugin \"p\"") && err.contains("cannot read /nonexistent/p.wasm"), "{err}");
    let (code, _, err) = kvgate(&["check", "--config", "/nonexistent.yaml"]);
    assert_eq!(code, 1);
    assert!(err.contains("/nonexistent.yaml"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The gateway runs with its allocator told to return freed memory at once (see
/// `ALLOCATOR_DEFAULTS` in main.rs): the binary runs itself again with the setting, in the same
/// process. A value the operator set is kept.
#[test]
fn the_gateway_runs_with_its_allocator_settings_unless_the_operator_set_them() {
    let dir = std::env::temp_dir().join(format!("kvgate-cli-alloc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("kvgate.yaml");
    std::fs::write(&cfg, "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nmodels:\n  - name: m\n    workers:\n      - url: http://127.0.0.1:1\n").unwrap();
    for (set, want) in [(None, "MIMALLOC_PURGE_DELAY=0"), (Some("250"), "MIMALLOC_PURGE_DELAY=250")] {
        let ports = dir.join("ports.json");
        let _ = std::fs::remove_file(&ports);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate"));
        cmd.args(["--config", cfg.to_str().unwrap(), "--ports-file", ports.to_str().unwrap()]).env_remove("MIMALLOC_PURGE_DELAY");
        if let Some(v) = set {
            cmd.env("MIMALLOC_PURGE_DELAY", v);
        }
        let mut child = cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().expect("kvgate starts");
        // The ports file is written once the gateway bound its listeners: by then it is the
        // process that serves, whatever ran before it in that process.
        let started = std::time::Instant::now();
        while !ports.exists() {
            assert!(child.try_wait().unwrap().is_none(), "kvgate exited early");
            assert!(started.elapsed() < std::time::Duration::from_secs(30), "no ports file");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let environ = std::fs::read(format!("/proc/{}/environ", child.id())).unwrap();
        let _ = child.kill();
        let _ = child.wait();
        let vars: Vec<&[u8]> = environ.split(|&b| b == 0).collect();
        assert!(vars.contains(&want.as_bytes()), "{want} in the serving process's environment");
    }
    let _ = std::fs::remove_dir_all(dir);
}
