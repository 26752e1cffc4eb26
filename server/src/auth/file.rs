//! The auth file: TOML `[[identity]]` tables parsed into a [`Policy`]. Errors name the
//! identity and the field, never a token: a rejected file may be logged as it is.

use super::{Action, Identity, Policy};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// The actions an identity gets when its table names none: acquire and inspect, so
/// force_release is an explicit grant.
pub const DEFAULT_ACTIONS: [Action; 2] = [Action::Acquire, Action::Inspect];
/// The longest identity name, in bytes.
const MAX_IDENTITY_LEN: usize = 256;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    identity: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    #[serde(default, deserialize_with = "strings")]
    tokens: Vec<String>,
    #[serde(default, deserialize_with = "strings")]
    token_sha256: Vec<String>,
    #[serde(default)]
    subjects: Vec<String>,
    #[serde(default)]
    prefixes: Vec<String>,
    actions: Option<Vec<Action>>,
    #[serde(default)]
    admin: bool,
}

/// A list of strings whose errors never quote the value (it may be a token).
fn strings<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let value = toml::Value::deserialize(d)?;
    let toml::Value::Array(items) = value else {
        return Err(serde::de::Error::custom("must be a list of strings"));
    };
    items
        .into_iter()
        .map(|v| match v {
            toml::Value::String(s) => Ok(s),
            _ => Err(serde::de::Error::custom("must be a list of strings")),
        })
        .collect()
}

/// Parses an auth file's text. A file with no identity is refused: it would refuse
/// every call while the server looks healthy (an empty secret mounted, a file caught
/// half-written by a reload).
pub fn parse(text: &str) -> Result<Policy, String> {
    let file: File = toml::from_str(text).map_err(|e| describe(text, &e))?;
    if file.identity.is_empty() {
        return Err("defines no [[identity]]: every call would be refused".to_owned());
    }
    let mut policy = Policy::default();
    let mut names = BTreeSet::new();
    for entry in file.identity {
        let identity = build(entry, &mut policy)?;
        if !names.insert(identity.name.clone()) {
            return Err(format!("identity {:?} is defined twice", identity.name));
        }
        policy.identities.push(identity);
    }
    Ok(policy)
}

/// A TOML error as "line N: key: what was wrong". It quotes nothing of the file, whose
/// values and keys may be tokens: not the source line, and of serde's messages, which
/// quote the value ("invalid type: string \"…\"", "unknown variant `…`", "unknown field
/// `…`"), only what was expected. The key comes from the error's path, not the text.
fn describe(text: &str, e: &toml::de::Error) -> String {
    let what = without_value(e.message().trim());
    let what = match key(e) {
        Some(key) => format!("{key}: {what}"),
        None => what,
    };
    match e.span() {
        Some(span) => {
            let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
            format!("line {line}: {what}")
        }
        None => what,
    }
}

/// serde's data errors with the value they quote left out.
fn without_value(message: &str) -> String {
    const QUOTING: [(&str, &str); 4] = [
        ("invalid type:", "wrong type"),
        ("invalid value:", "invalid value"),
        ("unknown variant", "unknown value"),
        ("unknown field", "unknown key"),
    ];
    let Some((_, what)) = QUOTING.iter().find(|(start, _)| message.starts_with(start)) else {
        return message.to_owned();
    };
    // serde writes "<what the file held>, expected <what the type wants>": the last
    // ", expected " is the separator, whatever the file held.
    match message.rsplit_once(", expected ") {
        Some((_, expected)) => format!("{what}, expected {expected}"),
        None => (*what).to_owned(),
    }
}

/// The last key of the error's path when it is one of the file's own keys. toml keeps
/// the path private and shows it, "in `identity.admin`", when it shows no source.
fn key(e: &toml::de::Error) -> Option<&'static str> {
    const KEYS: [&str; 8] = [
        "identity",
        "name",
        "tokens",
        "token_sha256",
        "subjects",
        "prefixes",
        "actions",
        "admin",
    ];
    let mut bare = e.clone();
    bare.set_input(None);
    let shown = bare.to_string();
    let path = shown
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("in `")?.strip_suffix('`'))?;
    let last = path.rsplit('.').next()?;
    KEYS.into_iter().find(|k| *k == last)
}

/// Checks one `[[identity]]` and indexes its tokens and subjects into `policy`.
fn build(entry: Entry, policy: &mut Policy) -> Result<Arc<Identity>, String> {
    let name = entry.name;
    check_name(&name)?;
    let at = |field: &str, what: &str| format!("identity {name:?}: {field} {what}");
    if entry.tokens.is_empty() && entry.token_sha256.is_empty() && entry.subjects.is_empty() {
        return Err(at(
            "tokens, token_sha256 or subjects",
            "must name at least one credential",
        ));
    }
    if !entry.admin && entry.prefixes.is_empty() {
        return Err(at("prefixes", "must name at least one prefix (\"\" for every name)"));
    }
    // An admin may do everything on every name: limits beside it would be ignored,
    // and an identity meant to read everything would break locks.
    for (field, given) in [
        ("prefixes", !entry.prefixes.is_empty()),
        ("actions", entry.actions.is_some()),
    ] {
        if entry.admin && given {
            return Err(at(
                field,
                "must not be given with admin = true (an admin may do everything; to inspect every name, use prefixes = [\"\"] and actions = [\"inspect\"])",
            ));
        }
    }
    let mut digests = Vec::new();
    for token in &entry.tokens {
        if token.is_empty() {
            return Err(at("tokens", "must not hold an empty token"));
        }
        if !sendable(token) {
            return Err(at(
                "tokens",
                "must hold printable ASCII tokens without spaces at either end (a client can send no other)",
            ));
        }
        digests.push(Sha256::digest(token.as_bytes()).into());
    }
    for hex in &entry.token_sha256 {
        digests.push(parse_sha256(hex).ok_or_else(|| at("token_sha256", "must hold 64 hex digits per token"))?);
    }
    let actions: BTreeSet<Action> = entry
        .actions
        .unwrap_or_else(|| DEFAULT_ACTIONS.to_vec())
        .into_iter()
        .collect();
    let identity = Arc::new(Identity {
        name: name.clone(),
        admin: entry.admin,
        prefixes: entry.prefixes,
        actions,
    });
    let index = policy.identities.len();
    for digest in digests {
        if let Some((_, other)) = policy.tokens.iter().find(|(d, _)| *d == digest) {
            let whose = if *other == index {
                "of its own"
            } else {
                "of another identity"
            };
            return Err(at("tokens", &format!("repeats a token {whose}")));
        }
        policy.tokens.push((digest, index));
    }
    index_subjects(&mut policy.subjects, entry.subjects, index).map_err(|s| at("subjects", &s))?;
    Ok(identity)
}

fn index_subjects(subjects: &mut HashMap<String, usize>, list: Vec<String>, index: usize) -> Result<(), String> {
    for subject in list {
        if subject.is_empty() {
            return Err("must not hold an empty subject".into());
        }
        if let Some(other) = subjects.insert(subject.clone(), index) {
            if other != index {
                return Err(format!("{subject:?} maps to another identity too"));
            }
        }
    }
    Ok(())
}

/// Identity names scope owner ids (`<identity>/<owner>`), so they may not hold `/`.
/// Whether a client can present `token`: gRPC metadata carries printable ASCII, and
/// the server reads the bearer token with the spaces around it trimmed, so a token
/// with others, or with a space at either end, would match no call.
fn sendable(token: &str) -> bool {
    let printable = token.bytes().all(|b| (b' '..=b'~').contains(&b));
    printable && token.trim_matches(' ') == token
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_IDENTITY_LEN {
        return Err(format!("identity name must be 1 to {MAX_IDENTITY_LEN} bytes"));
    }
    if name.contains('/') || name.chars().any(char::is_control) {
        return Err(format!(
            "identity name {name:?} must not contain '/' or control characters"
        ));
    }
    Ok(())
}

fn parse_sha256(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    // Hex digits only: from_str_radix takes a sign too (`+f` reads as 0x0f).
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Credential;

    const FILE: &str = r#"
[[identity]]
name = "billing"
tokens = ["billing-secret"]
prefixes = ["billing/"]

[[identity]]
name = "ops"
token_sha256 = ["2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"]
subjects = ["ops.internal"]
admin = true
"#;

    #[test]
    fn identities_parse_with_defaults() {
        let p = parse(FILE).unwrap();
        assert_eq!(p.identities.len(), 2);
        let billing = p.identify(&Credential::token("billing-secret")).unwrap();
        assert_eq!(billing.name, "billing");
        assert!(billing.may(Action::Acquire, "billing/x"));
        assert!(!billing.may(Action::Acquire, "orders"));
        assert!(!billing.may(Action::ForceRelease, "billing/x"));
        // sha256("secret")
        assert_eq!(p.identify(&Credential::token("secret")).unwrap().name, "ops");
        assert_eq!(
            p.identify(&Credential::Subjects(Arc::from(["ops.internal".to_owned()])))
                .unwrap()
                .name,
            "ops"
        );
        assert!(p.identify(&Credential::token("nope")).is_none());
    }

    #[test]
    fn errors_never_quote_tokens() {
        for text in [
            "[[identity]]\nname = \"a\"\ntokens = \"hunter2\"\nprefixes = [\"\"]\n",
            "[[identity]]\nname = \"a\"\ntokens = [\"hunter2\", 3]\nprefixes = [\"\"]\n",
            "[[identity]]\nname = \"a\"\ntokens = [\"hunter2\"\nprefixes = [\"\"]\n",
        ] {
            let e = parse(text).unwrap_err();
            assert!(!e.contains("hunter2"), "{e}");
        }
    }

    #[test]
    fn bad_files_name_the_field() {
        let e = parse("[[identity]]\nname = \"a/b\"\ntokens = [\"t\"]\nprefixes = [\"\"]\n").unwrap_err();
        assert!(e.contains("'/'"), "{e}");
        let e = parse("[[identity]]\nname = \"a\"\ntokens = [\"t\"]\n").unwrap_err();
        assert!(e.contains("prefixes"), "{e}");
        let e = parse("[[identity]]\nname = \"a\"\ntokens = [\"t\"]\nprefixes = [\"\"]\nactions = [\"fly\"]\n")
            .unwrap_err();
        assert_eq!(
            e,
            "line 5: actions: unknown value, expected one of `acquire`, `inspect`, `force_release`"
        );
        let e =
            parse("[[identity]]\nname = \"a\"\ntokens = [\"t\"]\nprefixes = [\"\"]\nadmin = \"yes\"\n").unwrap_err();
        assert_eq!(e, "line 5: admin: wrong type, expected a boolean");
        let e = parse("[[identity]]\nname = \"a\"\ntoken = [\"t\"]\nprefixes = [\"\"]\n").unwrap_err();
        assert!(
            e.starts_with("line 3: identity: unknown key, expected one of `name`"),
            "{e}"
        );
        let two = "[[identity]]\nname = \"a\"\ntokens = [\"t\"]\nprefixes = [\"\"]\n[[identity]]\nname = \"b\"\ntokens = [\"t\"]\nprefixes = [\"\"]\n";
        assert!(parse(two).unwrap_err().contains("of another identity"));
        let twice = "[[identity]]\nname = \"a\"\ntokens = [\"t\", \"t\"]\nprefixes = [\"\"]\n";
        assert!(parse(twice).unwrap_err().contains("repeats a token of its own"));
        // 64 characters that from_str_radix reads, signs among them, are no digest.
        let signed = format!(
            "[[identity]]\nname = \"a\"\ntoken_sha256 = [\"{}\"]\nprefixes = [\"\"]\n",
            "+f".repeat(32)
        );
        assert!(parse(&signed).unwrap_err().contains("token_sha256"));
    }

    /// A token no client can present (spaces around it, which the server trims from
    /// the header; a byte that is not printable ASCII, which gRPC metadata cannot
    /// carry) is refused, without quoting it; spaces inside one are kept.
    #[test]
    fn tokens_no_client_can_send_are_refused() {
        for token in [" hunter2", "hunter2 ", "hunter2\\t", "hunter2\\u00e9", "hunter2\\n"] {
            let text = format!("[[identity]]\nname = \"a\"\ntokens = [\"{token}\"]\nprefixes = [\"\"]\n");
            let e = parse(&text).unwrap_err();
            assert!(e.contains("identity \"a\": tokens must hold printable ASCII"), "{e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
        let p = parse("[[identity]]\nname = \"a\"\ntokens = [\"two words\"]\nprefixes = [\"\"]\n").unwrap();
        assert_eq!(p.identify(&Credential::token("two words")).unwrap().name, "a");
    }

    /// An admin with limits beside it (ignored, so a "read-only" admin could break
    /// locks), and a file with no identity (every call refused, the server healthy),
    /// are refused.
    #[test]
    fn an_admin_with_limits_and_a_file_with_no_identity_are_refused() {
        for field in ["actions = [\"inspect\"]", "prefixes = [\"ops/\"]"] {
            let text = format!("[[identity]]\nname = \"d\"\ntokens = [\"t\"]\nadmin = true\n{field}\n");
            let e = parse(&text).unwrap_err();
            let named = field.split(' ').next().unwrap();
            assert!(
                e.contains(&format!("identity \"d\": {named} must not be given with admin")),
                "{e}"
            );
        }
        for text in ["", "# nobody yet\n"] {
            assert!(parse(text).unwrap_err().contains("no [[identity]]"), "{text:?}");
        }
    }
}
