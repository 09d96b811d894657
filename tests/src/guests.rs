//! The plugin guests (plugins/examples, plugins/guests) as `.wasm` files, built on first use
//! with plugins/build.sh (cargo serializes concurrent builds on its own lock).

use std::path::PathBuf;
use std::sync::OnceLock;

/// The component built from the guest crate `name` (e.g. `session-affinity`).
pub fn path(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    let plugins = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plugins");
    BUILT.get_or_init(|| {
        let out = std::process::Command::new("bash").arg(plugins.join("build.sh")).env("QUIET", "1").output().expect("run plugins/build.sh");
        assert!(out.status.success(), "plugins/build.sh failed:\n{}", String::from_utf8_lossy(&out.stderr));
    });
    let file = plugins.join("target/wasm32-wasip2/release").join(format!("{}.wasm", name.replace('-', "_")));
    assert!(file.exists(), "{} was not built", file.display());
    file
}
