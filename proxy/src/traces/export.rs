//! The exporter in force: an OpenTelemetry tracer provider with a batch span processor and an
//! OTLP/HTTP (protobuf) span exporter, built from the `tracing` section and replaced when a
//! reload changes it. Spans are handed to the processor's own thread and posted from a
//! one-thread tokio runtime of the exporter's, so neither waiting for a collector nor a slow
//! one touches the gateway's workers; a full batch queue drops spans rather than waiting.

use super::request::RequestTrace;
use crate::config::tracing::Tracing;
use crate::h1::request_head::RequestHead;
use arc_swap::ArcSwapOption;
use bytes::Bytes;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, Tracer};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long one export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The tracer provider in force, if tracing is on.
#[derive(Default)]
pub struct Exporter {
    current: ArcSwapOption<Pipeline>,
    /// Whether `current` holds one: what a request reads when tracing is off.
    on: AtomicBool,
    /// Set at shutdown: a reload after it builds nothing that would never be flushed.
    stopped: AtomicBool,
}

/// What a configuration changes, built and not yet in force ([`Exporter::prepare`]).
pub enum Prepared {
    /// Nothing: the exporter in force is the one asked for (or the gateway is stopping).
    Same,
    /// Tracing off.
    Off,
    /// This exporter.
    On(Arc<Pipeline>),
}

/// One configuration's provider and tracer.
pub struct Pipeline {
    cfg: Tracing,
    provider: SdkTracerProvider,
    tracer: Tracer,
}

impl Exporter {
    /// Puts `cfg` in force ([`Exporter::prepare`] then [`Exporter::commit`]).
    pub fn apply(&self, cfg: Option<&Tracing>) -> Result<(), String> {
        let prepared = self.prepare(cfg)?;
        self.commit(prepared);
        Ok(())
    }

    /// Builds what `cfg` asks for when it differs from what is in force (nothing when tracing
    /// is off or the gateway is stopping): the fallible half of a reload, done before anything
    /// else changes.
    pub fn prepare(&self, cfg: Option<&Tracing>) -> Result<Prepared, String> {
        let want = cfg.filter(|c| c.otlp_endpoint.is_some());
        let current = self.current.load();
        if current.as_ref().map(|p| &p.cfg) == want || self.stopped.load(Ordering::Acquire) {
            return Ok(Prepared::Same);
        }
        Ok(match want {
            Some(cfg) => Prepared::On(Arc::new(build(cfg)?)),
            None => Prepared::Off,
        })
    }

    /// Puts a prepared exporter in force; the one it replaces flushes what it holds and stops
    /// on a thread of its own.
    pub fn commit(&self, prepared: Prepared) {
        let next = match prepared {
            Prepared::Same => return,
            Prepared::Off => None,
            Prepared::On(p) => Some(p),
        };
        self.on.store(next.is_some(), Ordering::Release);
        if let Some(old) = self.current.swap(next) {
            retire(old);
        }
    }

    /// A trace for a request that arrived at `arrived` with `client`'s headers, when tracing
    /// is on.
    pub fn start(&self, client: &RequestHead, arrived: Instant) -> Option<Box<RequestTrace>> {
        if !self.on.load(Ordering::Acquire) {
            return None;
        }
        let p = self.current.load();
        p.as_ref().map(|p| Box::new(RequestTrace::start(&p.tracer, client, arrived)))
    }

    /// Exports what is still buffered and stops (the gateway is stopping). Blocks until the
    /// collector took the spans or the export timed out: call it off the async workers.
    pub fn shutdown(&self) {
        self.stopped.store(true, Ordering::Release);
        self.on.store(false, Ordering::Release);
        if let Some(p) = self.current.swap(None)
            && let Err(e) = p.provider.shutdown()
        {
            tracing::debug!(error = %e, "stopping the trace exporter");
        }
    }
}

/// Shuts `old` down off the caller's thread: a flush waits for the collector.
fn retire(old: Arc<Pipeline>) {
    let spawned = std::thread::Builder::new().name("kvgate-otlp-stop".into()).spawn(move || {
        if let Err(e) = old.provider.shutdown() {
            tracing::debug!(error = %e, "stopping the trace exporter");
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "could not start a thread to stop the trace exporter");
    }
}

/// A provider for `cfg` (tracing on).
fn build(cfg: &Tracing) -> Result<Pipeline, String> {
    let url = cfg.traces_url().ok_or("tracing has no otlp_endpoint")?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(OwnRuntime::new()?)
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url)
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| format!("tracing: the OTLP exporter: {e}"))?;
    let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(cfg.sample_ratio)));
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(sampler)
        .with_resource(Resource::builder().with_service_name(cfg.service_name.clone()).build())
        .build();
    let tracer = provider.tracer("kvgate");
    Ok(Pipeline { cfg: cfg.clone(), provider, tracer })
}

/// Hyper's client, run on a runtime of its own: the batch processor's thread awaits each
/// export on an executor without a tokio reactor.
#[derive(Debug)]
struct OwnRuntime {
    runtime: Option<tokio::runtime::Runtime>,
    client: opentelemetry_http::hyper::HyperClient,
}

impl OwnRuntime {
    fn new() -> Result<Self, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvgate-otlp")
            .enable_all()
            .build()
            .map_err(|e| format!("tracing: the exporter's runtime: {e}"))?;
        let client = opentelemetry_http::hyper::HyperClient::with_default_connector(EXPORT_TIMEOUT, None);
        Ok(Self { runtime: Some(runtime), client })
    }
}

#[async_trait::async_trait]
impl HttpClient for OwnRuntime {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let Some(rt) = &self.runtime else { return Err("the exporter is stopping".into()) };
        let client = self.client.clone();
        rt.spawn(async move { client.send_bytes(request).await }).await?
    }
}

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        // Dropping a runtime blocks, which an async caller may not do.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(endpoint: &str) -> Tracing {
        Tracing { otlp_endpoint: Some(endpoint.into()), sample_ratio: 1.0, service_name: "kvgate".into() }
    }

    #[test]
    fn a_reload_builds_only_what_changed_and_nothing_after_shutdown() {
        let e = Exporter::default();
        assert!(matches!(e.prepare(None).unwrap(), Prepared::Same), "off and asked off");
        e.apply(Some(&cfg("http://127.0.0.1:4318"))).unwrap();
        assert!(e.on.load(Ordering::Acquire));
        assert!(matches!(e.prepare(Some(&cfg("http://127.0.0.1:4318"))).unwrap(), Prepared::Same));
        assert!(matches!(e.prepare(Some(&cfg("http://127.0.0.1:4319"))).unwrap(), Prepared::On(_)));
        // A prepared change that is not committed changes nothing (a reload that failed later).
        assert!(e.current.load().as_ref().is_some_and(|p| p.cfg == cfg("http://127.0.0.1:4318")));
        e.apply(None).unwrap();
        assert!(!e.on.load(Ordering::Acquire) && e.current.load().is_none());
        e.shutdown();
        e.apply(Some(&cfg("http://127.0.0.1:4318"))).unwrap();
        assert!(!e.on.load(Ordering::Acquire), "a reload after shutdown starts no exporter");
    }
}
