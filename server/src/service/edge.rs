//! What a call meets outside the generated code: the name of its `LockService`
//! method, its gRPC deadline, and the refusal of a request over `--max-message-size` that tonic's decoder
//! answers before the method runs (a unary call or a `Watch`, of `LockService` or of
//! the health service).

use futures::future::{BoxFuture, Either};
use futures::FutureExt;
use std::task::{Context, Poll};
use tonic::codegen::{http, Service};
use tonic::server::NamedService;
use tonic::{Code, Status};

/// The `LockService` method a request calls, as the metrics name it; none for another
/// service's (the health service has a `Watch` too).
pub fn rpc_method<B>(req: &http::Request<B>) -> Option<&'static str> {
    let (service, called) = req.uri().path().strip_prefix('/')?.split_once('/')?;
    if service != latchkey_proto::v1::lock_service_server::SERVICE_NAME {
        return None;
    }
    crate::metrics::METHODS.iter().copied().find(|m| *m == called)
}

/// The call's gRPC deadline (its `grpc-timeout` header: up to eight digits and a unit),
/// none when it has none or one that does not parse. tonic applies it only until the
/// response's headers, which an `Acquire` sends with `queued`: the wait applies it
/// after that (`open.wait_timeout` at most this).
pub fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<std::time::Duration> {
    use std::time::Duration;
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// A service with its requests over `--max-message-size` refused as the README says.
/// It goes inside the auth interceptor (whose responses it could not rebuild). (A
/// stream's later messages are read by its method: `Acquire` answers an oversized one
/// itself; reflection's stream ends `OUT_OF_RANGE`, naming the sizes.)
#[derive(Debug, Clone)]
pub struct Oversized<S>(pub S);

impl<S: NamedService> NamedService for Oversized<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for Oversized<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    ResBody: Default + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<S::Future, BoxFuture<'static, Result<S::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        let method = rpc_method(&req);
        let response = self.0.call(req);
        match method {
            // The stream reads its messages itself, and answers an oversized one so.
            Some("Acquire") => Either::Left(response),
            method => Either::Right(response.map(move |r| r.map(|r| refused(method, r))).boxed()),
        }
    }
}

/// `response`, or the limit's status in place of tonic's `OUT_OF_RANGE` for a request
/// that did not decode for its size (no method of ours, nor the health service,
/// answers `OUT_OF_RANGE`); such a call never reached the `LockService` `method`,
/// which counts the others in the RPC metrics.
fn refused<B: Default>(method: Option<&'static str>, response: http::Response<B>) -> http::Response<B> {
    match Status::from_header_map(response.headers()) {
        Some(status) if status.code() == Code::OutOfRange => {
            if let Some(method) = method {
                crate::metrics::rpc_started(method);
                crate::metrics::rpc_handled(method, Code::ResourceExhausted);
            }
            too_large(&status).into_http()
        }
        _ => response,
    }
}

/// The limit's status for tonic's refusal of a message over `--max-message-size`
/// (`OUT_OF_RANGE`, whose message gives the sizes).
pub fn too_large(decoder: &Status) -> Status {
    crate::error::Error::ResourceExhausted(format!("{} (--max-message-size)", decoder.message())).into()
}

#[cfg(test)]
mod tests {
    use super::{grpc_timeout, rpc_method};
    use std::time::Duration;
    use tonic::codegen::http;

    fn method(path: &str) -> Option<&'static str> {
        rpc_method(&http::Request::get(path).body(()).unwrap())
    }

    #[test]
    fn only_the_lock_services_methods_are_named() {
        assert_eq!(method("/latchkey.v1.LockService/Watch"), Some("Watch"));
        assert_eq!(method("/latchkey.v1.LockService/Acquire"), Some("Acquire"));
        // The health service's Watch is not the lock's, and counts in no lock metric.
        assert_eq!(method("/grpc.health.v1.Health/Watch"), None);
        assert_eq!(method("/latchkey.v1.LockService/Nothing"), None);
        assert_eq!(method("/Watch"), None);
    }

    #[test]
    fn a_grpc_timeout_header_is_read_in_each_unit() {
        let timeout = |value: &str| {
            let mut metadata = tonic::metadata::MetadataMap::new();
            metadata.insert("grpc-timeout", value.parse().unwrap());
            grpc_timeout(&metadata)
        };
        assert_eq!(timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(timeout("99999999S"), Some(Duration::from_secs(99_999_999)));
        assert_eq!(timeout("1500m"), Some(Duration::from_millis(1500)));
        assert_eq!(timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(timeout("0n"), Some(Duration::ZERO));
        for bad in ["", "S", "100000000S", "1.5S", "-1S", "10x", "10"] {
            assert_eq!(timeout(bad), None, "{bad:?}");
        }
        assert_eq!(grpc_timeout(&tonic::metadata::MetadataMap::new()), None);
    }
}
