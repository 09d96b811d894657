//! The `kvgate` binary: `kvgate --config FILE` runs the gateway; `kvgate demo` (feature `demo`,
//! on by default) runs it in front of simulated workers with no config; `kvgate check --config FILE`
//! validates a configuration, plugins included (exit 0 valid, 1 invalid, errors with line and
//! column).

use clap::{Parser, Subcommand};

/// mimalloc rather than glibc's malloc: see the dependency's note in Cargo.toml.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "kvgate", version, about = "KV-cache-aware gateway for vLLM fleets")]
struct Cli {
    /// Configuration file (YAML; see conf/kvgate.yaml).
    #[arg(long, short, global = true)]
    config: Option<PathBuf>,
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, global = true, default_value = "info", env = "KVGATE_LOG")]
    log: String,
    /// Once both listeners are bound, write their addresses and the instance id to this file as
    /// JSON (`{"listen": "host:port", "admin_listen": "host:port", "instance": "…"}`): with port
    /// 0 in the config, a supervisor or a benchmark learns the ports the system gave.
    #[arg(long, value_name = "FILE")]
    ports_file: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Validate a configuration and exit (0: valid, 1: invalid).
    Check,
    /// Run the gateway in front of simulated vLLM workers in this process (no config needed).
    #[cfg(feature = "demo")]
    Demo {
        /// Simulated workers.
        #[arg(long, default_value_t = 4)]
        workers: usize,
        /// Routing mode: kv, round_robin or random.
        #[arg(long, default_value = "kv", value_parser = ["kv", "round_robin", "random"])]
        mode: String,
        /// Public port (0: any free port).
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Admin port (0: any free port).
        #[arg(long, default_value_t = 9090)]
        admin_port: u16,
        /// Simulated time runs this many times faster than wall time.
        #[arg(long, default_value_t = 1.0)]
        time_scale: f64,
    },
}

/// The allocator's settings kvgate runs with unless the operator set them. mimalloc reads its
/// options from the environment once, before `main`, so they reach it by running the binary
/// again ([`with_allocator_defaults`]).
///
/// `MIMALLOC_PURGE_DELAY=0`: memory freed is returned to the system at once. mimalloc's
/// default (a delay, then a purge on a later allocation in the thread that freed it) kept an
/// idle gateway's resident memory at its high-water mark after a burst of connections
/// closed, which looks like a leak to an operator and to a container's memory limit.
const ALLOCATOR_DEFAULTS: [(&str, &str); 1] = [("MIMALLOC_PURGE_DELAY", "0")];

/// Runs this binary again, same arguments, with the [`ALLOCATOR_DEFAULTS`] the environment
/// lacks. Returns only when none is lacking, or when the new run could not start (then the
/// gateway runs on the allocator's own defaults, and says so).
fn with_allocator_defaults() {
    use std::os::unix::process::CommandExt;
    let missing: Vec<(&str, &str)> = ALLOCATOR_DEFAULTS.into_iter().filter(|(k, _)| std::env::var_os(k).is_none()).collect();
    if missing.is_empty() {
        return;
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return eprintln!("kvgate: cannot find its own binary ({e}); the allocator keeps its defaults"),
    };
    let mut args = std::env::args_os();
    let mut again = std::process::Command::new(exe);
    // The name it was started by stays its name (in `ps`, in a supervisor's view).
    if let Some(name) = args.next() {
        again.arg0(name);
    }
    let err = again.args(args).envs(missing).exec();
    eprintln!("kvgate: cannot run itself again with the allocator's settings ({err}); the allocator keeps its defaults");
}

fn main() {
    with_allocator_defaults();
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_target(false).init();
    let check = match cli.cmd {
        #[cfg(feature = "demo")]
        Some(Cmd::Demo { workers, mode, port, admin_port, time_scale }) => {
            std::process::exit(kvgate::demo::run(&kvgate::demo::DemoOptions { workers, mode, port, admin_port, time_scale }))
        }
        Some(Cmd::Check) => true,
        None => false,
    };
    let Some(path) = cli.config else {
        eprintln!("kvgate: --config FILE is required (see conf/kvgate.yaml)");
        std::process::exit(2);
    };
    let cfg = match kvgate::config::load::load_file(&path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    if !cfg.admin_listen.ip().is_loopback() && cfg.admin_token.is_none() {
        // Not refused: a private network may be the operator's choice; said loudly.
        eprintln!(
            "{}: warning: admin_listen {} is not a loopback address and no admin token is set (admin_token_file or KVGATE_ADMIN_TOKEN): anyone who reaches it can reload, migrate and list requests",
            path.display(),
            cfg.admin_listen
        );
    }
    if check {
        // Plugins are compiled and started as the gateway would, so a broken module fails here.
        for p in &cfg.plugins {
            if let Err(e) = kvgate_plugins::PluginSlot::load(kvgate::plugins::spec(p)) {
                eprintln!("{}: {e}", path.display());
                std::process::exit(1);
            }
        }
        let workers: usize = cfg.models.iter().map(|m| m.workers.len()).sum();
        println!("{}: ok ({} models, {workers} workers, {} plugins)", path.display(), cfg.models.len(), cfg.plugins.len());
    } else {
        kvgate::server::run(&cfg, Some(path), cli.ports_file.as_deref());
    }
}
