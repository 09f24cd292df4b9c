//! The kubelet API a node agent serves, the part the apiserver proxies to: `pods/log` reaches
//! `GET /containerLogs/{namespace}/{pod}/{container}` on the port the Node's
//! `daemonEndpoints` names, at its `InternalIP`. TLS with the node's serving certificate
//! (the real tier's apiserver does not verify it: it runs without
//! `--kubelet-certificate-authority`, as kubeadm does). The log is the container's stdout,
//! then its stderr, as the fast tier serves it (`tailLines` honoured).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::{Path as UrlPath, Query, State};
use axum::response::Response;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Why the API could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The serving certificate or key could not be read.
    #[error("serving certificate {path}: {message}")]
    Certificate {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
    /// The listener could not be bound.
    #[error("binding the kubelet API: {0}")]
    Bind(#[from] std::io::Error),
}

fn tls(cert: &Path, key: &Path) -> Result<tokio_rustls::TlsAcceptor, ServeError> {
    let fail = |path: &Path| {
        let path = path.to_owned();
        move |e: &dyn std::fmt::Display| ServeError::Certificate {
            path,
            message: e.to_string(),
        }
    };
    let certs = CertificateDer::pem_file_iter(cert)
        .map_err(|e| fail(cert)(&e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| fail(cert)(&e))?;
    let private = PrivateKeyDer::from_pem_file(key).map_err(|e| fail(key)(&e))?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| fail(cert)(&e))?
        .with_no_client_auth()
        .with_single_cert(certs, private)
        .map_err(|e| fail(cert)(&e))?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

async fn container_log(
    State(logs): State<Arc<PathBuf>>,
    UrlPath((ns, pod, _container)): UrlPath<(String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    crate::http::pod_log(&logs, &ns, &pod, &query)
}

/// Serves the API on a free loopback port until the process ends; returns the port. `logs`
/// is where the node's kubelet writes each container's output.
pub async fn serve(cert: &Path, key: &Path, logs: PathBuf) -> Result<u16, ServeError> {
    let acceptor = tls(cert, key)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let app = axum::Router::new()
        .route(
            "/containerLogs/{namespace}/{pod}/{container}",
            axum::routing::get(container_log),
        )
        .with_state(Arc::new(logs));
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper_util::service::TowerToHyperService::new(app);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(port)
}
