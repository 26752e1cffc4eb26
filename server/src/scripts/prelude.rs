//! The part of the shared helpers (the header's constants and `lib.lua`) that one
//! script uses. Redis runs a script's whole text at every call, so each helper the text
//! defines is built anew each time, used or not: the whole of `lib.lua` cost a lone
//! call 6–9 µs of Redis's time before the script's first command, as much as the rest
//! of an uncontended acquire. A script carries only the definitions its body names,
//! and the ones those name in turn, in `lib.lua`'s order.

use std::collections::HashSet;

/// One top-level definition of the prelude: the names it binds and its lines of code.
struct Definition<'a> {
    names: Vec<&'a str>,
    lines: Vec<&'a str>,
}

/// The definitions of `prelude` that `body` needs, in their order, as Lua text.
///
/// A definition is needed when its name appears as a word of the body or of a needed
/// definition: a word in a comment or a string may bring in one more than needed,
/// never one fewer. A helper names only helpers defined before it (any other name is a
/// global, which Redis refuses), so one pass from the last definition to the first
/// finds them all.
pub fn needed(prelude: &str, body: &str) -> String {
    let definitions = definitions(prelude);
    let mut wanted: HashSet<&str> = words(body).collect();
    let mut kept = vec![false; definitions.len()];
    for (i, d) in definitions.iter().enumerate().rev() {
        if d.names.iter().any(|n| wanted.contains(n)) {
            kept[i] = true;
            wanted.extend(d.lines.iter().flat_map(|l| words(l)));
        }
    }
    let mut text = String::new();
    for (d, _) in definitions.iter().zip(kept).filter(|(_, k)| *k) {
        for line in &d.lines {
            text.push_str(line);
            text.push('\n');
        }
    }
    text
}

/// Splits `prelude` into its top-level definitions, each from a line starting `local `
/// to the next; whole-line comments and blank lines are left out.
fn definitions(prelude: &str) -> Vec<Definition<'_>> {
    let mut definitions: Vec<Definition<'_>> = Vec::new();
    for line in prelude.lines() {
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with("--") {
            continue;
        }
        match (line.strip_prefix("local "), definitions.last_mut()) {
            (Some(rest), _) => definitions.push(Definition {
                names: bound(rest),
                lines: vec![line],
            }),
            (None, Some(last)) => last.lines.push(line),
            (None, None) => panic!("the prelude starts with a line that defines nothing: {line}"),
        }
    }
    definitions
}

/// The names a `local` line binds, given what follows `local `: `function f(…)` binds
/// `f`, `a, b = …` binds `a` and `b`.
pub(super) fn bound(rest: &str) -> Vec<&str> {
    let names = match rest.strip_prefix("function ") {
        Some(f) => f.split('(').next().unwrap_or(""),
        None => rest.split('=').next().unwrap_or(""),
    };
    names.split(',').map(str::trim).filter(|n| !n.is_empty()).collect()
}

/// The identifier-like words of Lua text.
pub(super) fn words(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRELUDE: &str =
        "-- a clock\nlocal ONE, TWO = 1, 2\n\nlocal function a()\n    -- uses ONE\n    return ONE\nend\n\
                           local function b()\n    return a() + TWO\nend\nlocal function c()\n    return 3\nend\n";

    #[test]
    fn a_body_gets_what_it_names_and_what_that_names() {
        assert_eq!(
            needed(PRELUDE, "return b()"),
            "local ONE, TWO = 1, 2\nlocal function a()\n    return ONE\nend\nlocal function b()\n    return a() + TWO\nend\n"
        );
        assert_eq!(needed(PRELUDE, "return c()"), "local function c()\n    return 3\nend\n");
        assert_eq!(needed(PRELUDE, "return 1"), "");
    }

    #[test]
    fn a_word_in_a_comment_or_a_longer_name_counts_as_written() {
        assert_eq!(
            needed(PRELUDE, "-- c\nreturn cc"),
            "local function c()\n    return 3\nend\n"
        );
    }

    #[test]
    fn every_definition_of_the_real_prelude_binds_a_name() {
        let lib = include_str!("lib.lua");
        let all = definitions(lib);
        assert!(all.len() > 50);
        for d in &all {
            assert!(!d.names.is_empty(), "{:?}", d.lines.first());
            assert!(d.names.iter().all(|n| words(n).count() == 1), "{:?}", d.names);
        }
        // Every definition kept for a body that names them all.
        let names: Vec<&str> = all.iter().flat_map(|d| d.names.clone()).collect();
        assert_eq!(definitions(&needed(lib, &names.join(" "))).len(), all.len());
    }
}
