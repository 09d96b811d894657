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
