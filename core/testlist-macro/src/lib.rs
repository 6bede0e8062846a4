//! `#[collect]`: a unit-test module of `mlx5-core` as a list of plain functions.
//!
//! The standard test harness needs std, so on a microcontroller the core's tests are run by a harness of their
//! own (`core/tests-m4`). This attribute, applied to a test module only under the core's `testlist` feature,
//! keeps every `#[test]` function in non-test builds (as `#[cfg_attr(test, test)]`, so `cargo test` sees the
//! same tests) and appends `pub(crate) const TESTS: &[crate::testlist::Test]` naming them. A test marked
//! `#[cfg(test)]` (one that needs std) or `#[ignore]` is left out of the list. No `syn`: the module's items are
//! walked at the top level only, attributes first, then `fn NAME`.

use proc_macro::{Delimiter, Group, TokenStream, TokenTree};

/// Lists the `#[test]` functions of the inline module it is applied to (see the crate documentation).
#[proc_macro_attribute]
pub fn collect(attr: TokenStream, item: TokenStream) -> TokenStream {
    if !attr.is_empty() {
        return error("#[collect] takes no arguments");
    }
    let mut tokens: Vec<TokenTree> = item.into_iter().collect();
    let body = match tokens.last() {
        Some(TokenTree::Group(g)) if g.delimiter() == Delimiter::Brace => g.stream(),
        _ => return error("#[collect] applies to an inline module: `mod tests { ... }`"),
    };
    let is_mod = tokens.iter().any(|t| matches!(t, TokenTree::Ident(i) if i.to_string() == "mod"));
    if !is_mod {
        return error("#[collect] applies to an inline module: `mod tests { ... }`");
    }
    let body = match rewrite(body) {
        Ok(b) => b,
        Err(e) => return error(&e),
    };
    let last = tokens.len() - 1;
    tokens[last] = TokenTree::Group(Group::new(Delimiter::Brace, body));
    // The list is read from `crate::testlist`, so the module is made visible to the crate.
    let public = tokens.iter().any(|t| matches!(t, TokenTree::Ident(i) if i.to_string() == "pub"));
    let at = tokens.iter().position(|t| matches!(t, TokenTree::Ident(i) if i.to_string() == "mod"));
    if let (false, Some(at)) = (public, at) {
        match parse("pub(crate)") {
            Ok(vis) => {
                tokens.splice(at..at, vis);
            }
            Err(e) => return error(&e),
        }
    }
    tokens.into_iter().collect()
}

/// One listed test: its function and what `#[should_panic]` expects (`Some("")`: any panic).
struct Listed {
    name: String,
    should_panic: Option<String>,
}

/// What the attributes seen since the last item said about the next one.
#[derive(Default)]
struct Pending {
    test: bool,
    host_only: bool,
    ignored: bool,
    should_panic: Option<String>,
}

fn rewrite(body: TokenStream) -> Result<TokenStream, String> {
    let toks: Vec<TokenTree> = body.into_iter().collect();
    let mut out: Vec<TokenTree> = Vec::with_capacity(toks.len());
    let mut listed = Vec::new();
    let mut p = Pending::default();
    let mut i = 0;
    while i < toks.len() {
        match (&toks[i], toks.get(i + 1)) {
            (TokenTree::Punct(h), Some(TokenTree::Group(g)))
                if h.as_char() == '#' && g.delimiter() == Delimiter::Bracket =>
            {
                let inner: Vec<TokenTree> = g.stream().into_iter().collect();
                let head = match inner.first() {
                    Some(TokenTree::Ident(id)) => id.to_string(),
                    _ => String::new(),
                };
                match head.as_str() {
                    "test" if inner.len() == 1 => {
                        p.test = true;
                        out.extend(parse("#[cfg_attr(test, test)]")?);
                    }
                    "should_panic" => {
                        p.should_panic = Some(expected(&inner)?);
                        let args: TokenStream = inner[1..].iter().cloned().collect();
                        out.extend(parse(&format!("#[cfg_attr(test, should_panic{args})]"))?);
                    }
                    "ignore" => {
                        p.ignored = true;
                        out.extend(parse("#[cfg_attr(test, ignore)]")?);
                    }
                    _ => {
                        if head == "cfg" && g.stream().to_string().replace(' ', "") == "cfg(test)" {
                            p.host_only = true;
                        }
                        out.push(toks[i].clone());
                        out.push(toks[i + 1].clone());
                    }
                }
                i += 2;
                continue;
            }
            (TokenTree::Ident(id), next) if id.to_string() == "fn" => {
                if p.test && !p.host_only && !p.ignored {
                    let Some(TokenTree::Ident(name)) = next else {
                        return Err("#[test] on a fn without a name".into());
                    };
                    listed.push(Listed { name: name.to_string(), should_panic: p.should_panic.take() });
                }
                p = Pending::default();
            }
            // The end of any other item: its attributes were not a test's.
            (TokenTree::Punct(s), _) if s.as_char() == ';' => p = Pending::default(),
            (TokenTree::Group(g), _) if g.delimiter() == Delimiter::Brace => p = Pending::default(),
            _ => {}
        }
        out.push(toks[i].clone());
        i += 1;
    }
    let mut list = String::from(
        "/// This module's tests as plain functions, for a harness without std (feature `testlist`). Not \
         allowed to be dead: a module missing from `testlist::MODULES` is a warning.\n\
         pub(crate) const TESTS: &[crate::testlist::Test] = &[",
    );
    for t in &listed {
        let sp = match &t.should_panic {
            Some(e) => format!("Some({e:?})"),
            None => "None".into(),
        };
        list.push_str(&format!(
            "crate::testlist::Test {{ name: concat!(module_path!(), \"::{n}\"), run: {n}, should_panic: {sp} }},",
            n = t.name
        ));
    }
    list.push_str("];");
    out.extend(parse(&list)?);
    Ok(out.into_iter().collect())
}

/// The text `#[should_panic(expected = "...")]` expects, or "" for a bare `#[should_panic]`.
fn expected(inner: &[TokenTree]) -> Result<String, String> {
    let Some(TokenTree::Group(args)) = inner.get(1) else {
        return Ok(String::new());
    };
    let args: Vec<TokenTree> = args.stream().into_iter().collect();
    match args.as_slice() {
        [TokenTree::Ident(k), TokenTree::Punct(eq), TokenTree::Literal(lit)]
            if k.to_string() == "expected" && eq.as_char() == '=' =>
        {
            let s = lit.to_string();
            // A plain string literal: the runner compares text, so escapes are not expected here.
            match s.strip_prefix('"').and_then(|s| s.strip_suffix('"')) {
                Some(text) if !text.contains('\\') => Ok(text.to_string()),
                _ => Err(format!("#[should_panic(expected = ...)] needs a plain string literal, not {s}")),
            }
        }
        _ => Err("#[should_panic] takes only `expected = \"...\"`".into()),
    }
}

fn parse(s: &str) -> Result<TokenStream, String> {
    s.parse().map_err(|e| format!("mlx5-testlist-macro generated bad tokens: {e:?}"))
}

fn error(msg: &str) -> TokenStream {
    format!("compile_error!({msg:?});").parse().expect("a compile_error! invocation parses")
}
