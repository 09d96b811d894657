//! `vllm-sim` binary: parses `vllm serve`-like flags and runs a simulated server until
//! Ctrl-C/SIGTERM (exit 0) or an injected crash (exit 1).

use clap::Parser;
use vllm_sim::{SimArgs, SimServer};

#[tokio::main]
async fn main() {
    let args = SimArgs::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_target(false).init();
    let ports_file = args.ports_file.clone();
    // A file left by an earlier run must not pass for this one's while it starts.
    if let Some(p) = &ports_file {
        let _ = std::fs::remove_file(p);
    }
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
    if let Some(path) = ports_file
        && let Err(e) = write_ports_file(&path, &server)
    {
        eprintln!("vllm-sim: cannot write {}: {e}", path.display());
        server.shutdown().await;
        std::process::exit(1);
    }
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

/// The bound addresses as JSON, written whole: to a temporary name, then renamed, so a reader
/// polling for the file never sees half of it.
fn write_ports_file(path: &std::path::Path, server: &SimServer) -> std::io::Result<()> {
    let v = serde_json::json!({"url": server.url(), "kv_events": server.kv_event_endpoints(), "replay": server.replay_endpoints()});
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, v.to_string())?;
    std::fs::rename(&tmp, path)
}
