//! TLS on the listeners: rustls through Pingora's listener, with the certificate chain and key
//! of `tls` / `admin_tls` served by a resolver ([`CertStore`]) that swaps in new files without
//! a restart. The files are read again on every reload (SIGHUP, `POST /reload`, a change of
//! the config file) and when they themselves change, which `tasks::tls_reload` checks every
//! few seconds: a Kubernetes Secret mount swaps a symlink, which no event of the config
//! directory shows. A pair that does not load leaves the one in use in place.

use crate::config::TlsFiles;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use pingora::listeners::tls::TlsSettings;
use pingora::tls::sign::CertifiedKey;
use pingora::tls::{ClientHello, CryptoProvider, ResolvesServerCert};
use std::sync::Arc;
use std::time::SystemTime;

/// A listener's certificate and key, replaceable while it serves.
pub struct CertStore {
    files: TlsFiles,
    key: ArcSwap<CertifiedKey>,
    /// The files' modification times and sizes when last read: a change reloads them.
    stamp: Mutex<Stamp>,
}

/// What tells that a file changed.
type Stamp = [Option<(SystemTime, u64)>; 2];

impl std::fmt::Debug for CertStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertStore").field("files", &self.files).finish_non_exhaustive()
    }
}

impl CertStore {
    /// Reads `files`; the error names the file and what is wrong with it.
    pub fn load(files: &TlsFiles) -> Result<Arc<Self>, String> {
        let stamp = stamp(files);
        let key = read(files)?;
        Ok(Arc::new(Self { files: files.clone(), key: ArcSwap::from_pointee(key), stamp: Mutex::new(stamp) }))
    }

    /// The files it serves.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Reads the files again when `force` or when they changed since the last read. `Ok(true)`:
    /// the new pair is in use for the next handshakes (connections open keep theirs).
    pub fn reload(&self, force: bool) -> Result<bool, String> {
        let now = stamp(&self.files);
        {
            let mut last = self.stamp.lock();
            if !force && *last == now {
                return Ok(false);
            }
            // Recorded before the read, so a pair that fails to load is not tried every few
            // seconds until it changes again.
            *last = now;
        }
        let key = read(&self.files)?;
        self.key.store(Arc::new(key));
        Ok(true)
    }

    /// Pingora's listener settings serving this store's pair.
    pub fn settings(self: &Arc<Self>) -> TlsSettings {
        let cert = self.files.cert_file.to_string_lossy();
        let key = self.files.key_file.to_string_lossy();
        // The paths are only kept by Pingora: with a resolver set, it never reads them.
        let mut s = TlsSettings::intermediate(&cert, &key).expect("settings from paths never fail");
        s.set_cert_resolver(self.clone());
        s
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.key.load_full())
    }
}

fn stamp(files: &TlsFiles) -> Stamp {
    let one = |p: &std::path::Path| std::fs::metadata(p).ok().and_then(|m| Some((m.modified().ok()?, m.len())));
    [one(&files.cert_file), one(&files.key_file)]
}

/// Reads and checks a PEM certificate chain and its private key.
pub fn read(files: &TlsFiles) -> Result<CertifiedKey, String> {
    let (cert, key) = (files.cert_file.display(), files.key_file.display());
    for p in [&files.cert_file, &files.key_file] {
        std::fs::metadata(p).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    let loaded = pingora::tls::load_certs_and_key_files(&cert.to_string(), &key.to_string()).map_err(|e| format!("{cert} / {key}: {e}"))?;
    let Some((chain, private)) = loaded else {
        return Err(format!("{cert} holds no PEM certificate, or {key} no PEM private key (PKCS#8, PKCS#1 or SEC1)"));
    };
    pingora::tls::install_default_crypto_provider();
    let provider = CryptoProvider::get_default().ok_or("no TLS crypto provider")?;
    let signer = provider.key_provider.load_private_key(private).map_err(|e| format!("{key}: {e}"))?;
    let certified = CertifiedKey::new(chain, signer);
    certified.keys_match().map_err(|e| format!("{key} is not the key of {cert}: {e}"))?;
    Ok(certified)
}

/// The listeners' certificate stores. Built once at start: which listeners speak TLS changes
/// only on restart, while the files they serve are read again on every reload.
#[derive(Debug, Default)]
pub struct Certificates {
    /// The public listener's, with `tls`.
    pub public: Option<Arc<CertStore>>,
    /// The admin listener's, with `admin_tls`.
    pub admin: Option<Arc<CertStore>>,
}

impl Certificates {
    /// Loads the pairs `cfg` names.
    pub fn load(cfg: &crate::config::Config) -> Result<Self, String> {
        let one = |f: &Option<TlsFiles>| f.as_ref().map(CertStore::load).transpose();
        Ok(Self { public: one(&cfg.tls)?, admin: one(&cfg.admin_tls)? })
    }

    /// Reads every pair again (`force`) or those whose files changed; a pair that does not load
    /// is logged and counted, and the one in use stays
    /// (`kvgate_tls_reloads_total{listener,result}`).
    pub fn reload(&self, force: bool, metrics: &crate::metrics::Metrics) {
        for (listener, store) in [("public", &self.public), ("admin", &self.admin)] {
            let Some(store) = store else { continue };
            match store.reload(force) {
                Ok(false) => {}
                Ok(true) => {
                    tracing::info!(listener, cert = %store.files().cert_file.display(), "TLS certificate loaded");
                    metrics.tls_reloads.with_label_values(&[listener, "ok"]).inc();
                }
                Err(e) => {
                    tracing::error!(listener, error = %e, "TLS certificate not loaded; the previous one stays in use");
                    metrics.tls_reloads.with_label_values(&[listener, "rejected"]).inc();
                }
            }
        }
    }
}
