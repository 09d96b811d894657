//! A `select!` branch that may be switched off: [`or_never`] awaits a future when there is one
//! and never completes otherwise, so an optional source (a signal that could not be installed,
//! a move order a stream cannot take) keeps its place in the `select!` without a guard.

/// `f`'s output, or never when there is no `f`.
pub async fn or_never<F: std::future::Future>(f: Option<F>) -> F::Output {
    match f {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}
