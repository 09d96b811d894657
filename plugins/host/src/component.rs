//! Turning a `.wasm` file into a vetted component: read (bounded), check the optional sha256
//! pin, compile, refuse any import (the host grants none: no WASI filesystem, network, clock,
//! randomness or stdio), and tell which world it exports.

use crate::failure::LoadError;
use crate::sandbox::{HostState, Limits, engine};
use sha2::{Digest, Sha256};
use std::fmt::Write as _;
use std::path::PathBuf;
use wasmtime::component::types::ComponentItem;
use wasmtime::component::{Component, InstancePre, Linker};

/// Largest plugin file read.
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// Interface names the worlds export.
const ROUTING_EXPORT: &str = "kvgate:policy/routing@0.1.0";
const RESCHEDULING_EXPORT: &str = "kvgate:policy/rescheduling@0.1.0";

/// A plugin as the gateway's config declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginSpec {
    /// Name used in routing config, metrics and logs.
    pub name: String,
    /// The component file.
    pub path: PathBuf,
    /// Expected sha256 of the file (hex), if pinned.
    pub sha256: Option<String>,
    /// Text passed to the guest's `init`.
    pub config: String,
    /// Request headers the guest may see (lower-case).
    pub headers: Vec<String>,
    /// Per-call bounds.
    pub limits: Limits,
}

/// Which world a component implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Exports `routing`.
    Router,
    /// Exports `rescheduling`.
    Rescheduler,
}

/// A compiled, vetted component.
pub struct Compiled {
    /// What it was loaded from.
    pub spec: PluginSpec,
    /// sha256 of the file (hex).
    pub sha256: String,
    /// Its world.
    pub kind: Kind,
    /// The compiled code.
    pub component: Component,
}

/// sha256 (hex) of the plugin file, as `sha256:` pins expect it.
pub fn file_sha256(spec: &PluginSpec) -> Result<(Vec<u8>, String), LoadError> {
    let err = |message: String| LoadError { plugin: spec.name.clone(), message };
    let cannot = |e: std::io::Error| err(format!("cannot read {}: {e}", spec.path.display()));
    let file = std::fs::File::open(&spec.path).map_err(cannot)?;
    // Read at most one byte past the cap, so a file that grows while it is read is still bounded.
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(file, MAX_FILE_BYTES + 1), &mut bytes).map_err(cannot)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(err(format!("{} is larger than {MAX_FILE_BYTES} bytes, the limit for plugins", spec.path.display())));
    }
    let sha = hex(&Sha256::digest(&bytes));
    Ok((bytes, sha))
}

/// Reads, pins, compiles and vets `spec`'s file. Takes milliseconds to tens of
/// milliseconds: call it off the request path.
pub fn compile(spec: &PluginSpec) -> Result<Compiled, LoadError> {
    let err = |message: String| LoadError { plugin: spec.name.clone(), message };
    let (bytes, sha256) = file_sha256(spec)?;
    if let Some(pin) = &spec.sha256
        && !pin.eq_ignore_ascii_case(&sha256)
    {
        return Err(err(format!("{} has sha256 {sha256}, but the config pins {pin}", spec.path.display())));
    }
    let component =
        Component::new(engine(), &bytes).map_err(|e| err(format!("{} is not a valid WebAssembly component: {}", spec.path.display(), first_line(&e))))?;
    let ty = component.component_type();
    // An interface whose types the exports use appears as an import of types only; that
    // grants nothing. Anything that carries a function or a resource is refused.
    let imports: Vec<&str> = ty.imports(engine()).filter(|(_, ext)| !types_only(&ext.ty)).map(|(name, _)| name).collect();
    if !imports.is_empty() {
        return Err(err(format!(
            "the component imports {}; kvgate grants plugins no imports (no printing, files, network, clocks or randomness): remove the calls that need them",
            imports.join(", ")
        )));
    }
    let exports: Vec<&str> = ty.exports(engine()).map(|(name, _)| name).collect();
    let kind = if exports.contains(&ROUTING_EXPORT) {
        Kind::Router
    } else if exports.contains(&RESCHEDULING_EXPORT) {
        Kind::Rescheduler
    } else {
        return Err(err(format!(
            "the component exports [{}], not {ROUTING_EXPORT} or {RESCHEDULING_EXPORT}: build it with kvgate-policy-sdk (plugins/wit/policy.wit)",
            exports.join(", ")
        )));
    };
    Ok(Compiled { spec: spec.clone(), sha256, kind, component })
}

/// Pre-links `compiled` for instantiation: with an empty linker, since plugins import nothing.
/// `kind` is the world the caller needs; another one is refused with the reason.
pub(crate) fn link(compiled: &Compiled, kind: Kind) -> Result<InstancePre<HostState>, LoadError> {
    let err = |message: String| LoadError { plugin: compiled.spec.name.clone(), message };
    if compiled.kind != kind {
        return Err(err(match kind {
            Kind::Router => "it is a rescheduling policy; routing needs one built with the router world".into(),
            Kind::Rescheduler => "it is a routing policy; rescheduling needs one built with the rescheduler world".into(),
        }));
    }
    Linker::<HostState>::new(engine()).instantiate_pre(&compiled.component).map_err(|e| err(format!("cannot link: {e:#}")))
}

fn types_only(item: &ComponentItem) -> bool {
    match item {
        ComponentItem::Type(_) => true,
        ComponentItem::ComponentInstance(inst) => inst.exports(engine()).all(|(_, ext)| types_only(&ext.ty)),
        _ => false,
    }
}

fn first_line(e: &wasmtime::Error) -> String {
    format!("{e:#}").lines().next().unwrap_or("unknown error").to_string()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::with_capacity(2 * bytes.len()), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}
