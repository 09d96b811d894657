//! The logs of the gateways a test runs in its own process, kept with the test's output: a
//! test that fails shows what its gateway warned of (a worker that failed, a stream that was
//! cut, a move refused), and one that passes shows nothing. Without them, a failure that
//! happens once in many runs leaves only the client's side of the story.

use std::sync::Once;

/// Sends the process's `tracing` events (`warn` and above, or what `RUST_LOG` says) to the
/// test harness's captured output. Once per process; later calls do nothing.
///
/// The harness captures what the test's own thread and the threads it starts print (the
/// runtime's workers, a gateway's server thread), so each test's failure report carries its
/// own gateway's lines.
pub fn capture() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        // Another subscriber set first (a test that installs its own) keeps its place.
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().with_ansi(false).try_init();
    });
}
