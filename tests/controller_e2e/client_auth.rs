//! The kube-apiserver's client certificate: a webhook that does not accept it admits
//! nothing.

use std::time::Duration;

use kube::api::PostParams;

use clusterip_test_support::{control_plane, eventually_some};

use crate::harness::*;

/// The real kube-apiserver presents its client certificate (every other test here passes
/// only because it does); a webhook that does not accept it — the right CA, another name —
/// refuses the apiserver's connection before any request: the create fails with the
/// apiserver's TLS error, nothing admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_webhook_that_does_not_accept_the_apiservers_certificate_admits_nothing() {
    let cp = control_plane();
    let auth: Vec<String> = ["--client-ca-file", cp.var("CLUSTERIP_WEBHOOK_CLIENT_CA"), "--allowed-client-names", "someone-else"].iter().map(|s| s.to_string()).collect();
    let wh = Webhook::register(&cp, Harness::new(&cp, "etcd", Slice(9), |h| h.flags = auth)).await;
    let api = wh.services();
    // The apiserver picks the registration up asynchronously: until then creates succeed
    // (dry runs here, so nothing is held); then every create fails at the TLS handshake.
    let dry = PostParams { dry_run: true, ..Default::default() };
    let (api, dry) = (&api, &dry);
    let message = eventually_some("the apiserver calls the webhook", Duration::from_secs(60), Duration::from_millis(200), move || async move {
        match api.create(dry, &service("probe", |_| {})).await {
            Err(kube::Error::Api(s)) => Some(s.message),
            Ok(_) => None,
            Err(e) => panic!("probing the webhook registration: {e}"),
        }
    })
    .await;
    // The apiserver's words for the refusal depend on timing: with TLS 1.3 the client
    // certificate is judged after the client considers the handshake done, so the apiserver
    // reads our alert ("remote error: tls: unknown certificate"), or on a busy machine the
    // closed connection first ("unexpected EOF", or "http2: client conn could not be
    // established" when its HTTP/2 preface meets it; all three seen in soaks). What holds
    // every time: the call failed in transport ("failed to call webhook"), not as an answer
    // of ours ("denied the request"), and our log names the refused certificate.
    let refused = |m: &str| m.contains("failed calling webhook \"assign.clusterip.allocator\": failed to call webhook:") && !m.contains("denied the request");
    assert!(refused(&message), "{message}");
    match api.create(&PostParams::default(), &service("refused", |_| {})).await {
        Err(kube::Error::Api(s)) => assert!(s.code == 500 && refused(&s.message), "{s:?}"),
        other => panic!("a create through a webhook refusing the apiserver: {other:?}"),
    }
    let log = wh.children[0].log();
    assert!(log.contains("refused a connection: no valid client certificate") && log.contains("someone-else"), "{log}");
}
