//! `vllm-sim` binary: parses `vllm serve`-like flags and runs a simulated server until
//! Ctrl-C/SIGTERM (exit 0) or an injected crash (exit 1).

use clap::Parser;
use vllm_sim::{SimArgs, SimServer};

#[tokio::main]
async fn main() {
    let args = SimArgs::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_target(false).init();
    let cfg = match args.into_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vllm-sim: {e}");
            std::process::exit(2);
        }
    };
    let server = match SimServer::start(cfg).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vllm-sim: {e}");
            std::process::exit(1);
        }
    };
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vllm-sim: cannot install SIGTERM handler: {e}");
            std::process::exit(1);
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        _ = server.stopped() => {}
    }
    let crashed = server.faults().is_crashed();
    server.shutdown().await;
    std::process::exit(if crashed { 1 } else { 0 });
}
