//! The `kvgate` binary: `kvgate --config FILE` runs the gateway; `kvgate check --config FILE`
//! validates a configuration (exit 0 valid, 1 invalid, errors with line and column).

use clap::{Parser, Subcommand};
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
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Validate a configuration and exit (0: valid, 1: invalid).
    Check,
}

fn main() {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_target(false).init();
    let Some(path) = cli.config else {
        eprintln!("kvgate: --config FILE is required (see conf/kvgate.yaml)");
        std::process::exit(2);
    };
    let cfg = match kvgate::config::load_file(&path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    match cli.cmd {
        Some(Cmd::Check) => {
            let workers: usize = cfg.models.iter().map(|m| m.workers.len()).sum();
            println!("{}: ok ({} models, {workers} workers)", path.display(), cfg.models.len());
        }
        None => kvgate::server::run(cfg, Some(path)),
    }
}
