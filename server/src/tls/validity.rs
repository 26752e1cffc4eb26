//! The validity periods of the certificates the server serves and trusts. An expired
//! (or not yet valid) certificate loads, and health says SERVING, while every
//! handshake that checks it fails: the server warns at start and on every reload, and
//! a gauge tells monitoring when each file's certificates run out, to renew before.

use rustls::pki_types::CertificateDer;
use std::path::Path;
use x509_parser::time::ASN1Time;

/// The soonest end of the certificates of `--tls-<flag>`, for the gauge.
pub(super) type Expiry = (&'static str, Option<i64>);

/// Checks the certificates read from `path`, the file of `--tls-<flag>`: warns of each
/// one outside its validity now. Returns when the first of them runs out.
pub(super) fn check(flag: &'static str, path: &Path, certs: &[CertificateDer<'_>]) -> Expiry {
    let (soonest, problems) = examine(certs, ASN1Time::now());
    for problem in problems {
        tracing::warn!(file = %path.display(), "--tls-{flag}: {problem}; peers will refuse it");
    }
    (flag, soonest)
}

/// Sets `latchkey_tls_certificate_expiry_timestamp_seconds{file=flag}`.
pub(super) fn publish((flag, soonest): Expiry) {
    if let Some(end) = soonest {
        crate::metrics::certificate_expiry(flag, end);
    }
}

/// The soonest end of validity among `certs` (Unix seconds), and what is wrong with
/// each certificate outside its validity at `now`. A certificate that does not parse
/// is left to the handshake's own checks.
fn examine(certs: &[CertificateDer<'_>], now: ASN1Time) -> (Option<i64>, Vec<String>) {
    let mut soonest = None::<i64>;
    let mut problems = Vec::new();
    for der in certs {
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(der.as_ref()) else {
            continue;
        };
        let validity = cert.validity();
        let end = validity.not_after.timestamp();
        soonest = Some(soonest.map_or(end, |s| s.min(end)));
        if validity.not_after < now {
            problems.push(format!(
                "the certificate of {} expired on {}",
                cert.subject(),
                validity.not_after
            ));
        } else if now < validity.not_before {
            problems.push(format!(
                "the certificate of {} is not valid before {}",
                cert.subject(),
                validity.not_before
            ));
        }
    }
    (soonest, problems)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{date_time_ymd, CertificateParams, DnType, KeyPair};

    fn cert(cn: &str, from: (i32, u8, u8), to: (i32, u8, u8)) -> CertificateDer<'static> {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.not_before = date_time_ymd(from.0, from.1, from.2);
        params.not_after = date_time_ymd(to.0, to.1, to.2);
        params.self_signed(&KeyPair::generate().unwrap()).unwrap().der().clone()
    }

    #[test]
    fn certificates_outside_their_validity_are_named_and_the_soonest_end_counts() {
        let now = ASN1Time::from_timestamp(1_800_000_000).unwrap(); // January 2027
        let valid = cert("valid", (2026, 1, 1), (2030, 1, 1));
        let expired = cert("expired", (2020, 1, 1), (2021, 1, 1));
        let early = cert("early", (2029, 1, 1), (2031, 1, 1));

        let (soonest, problems) = examine(std::slice::from_ref(&valid), now);
        assert_eq!(soonest, Some(1_893_456_000));
        assert!(problems.is_empty(), "{problems:?}");

        let (soonest, problems) = examine(&[valid, expired, early], now);
        assert_eq!(soonest, Some(1_609_459_200), "the expired one ends first");
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(
            problems[0].contains("CN=expired expired on Jan  1 00:00:00 2021"),
            "{}",
            problems[0]
        );
        assert!(
            problems[1].contains("CN=early is not valid before Jan  1 00:00:00 2029"),
            "{}",
            problems[1]
        );

        assert_eq!(examine(&[CertificateDer::from(vec![1, 2, 3])], now), (None, vec![]));
    }
}
