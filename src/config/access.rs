//! `[http]` access: who may use the listener ([`HttpAccess`]): the API
//! tokens of `tokens_file` (named, scoped, kept as SHA-256 digests), whether
//! reading needs one, and TLS from `tls_cert_file`/`tls_key_file`. Loaded
//! with the configuration, so `cronlease check` finds a bad tokens file or
//! certificate, and a reload (SIGHUP) applies new ones.

use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::*;

/// What a token may do. `read`: the read endpoints (when they need a
/// token at all); `operate`: also the writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    Read,
    Operate,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Operate => "operate",
        }
    }
}

/// One API token: its name (who, in the audit and the logs), its scope,
/// and the SHA-256 digest of its secret; the secret itself is never kept.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiToken {
    pub name: String,
    pub scope: Scope,
    digest: [u8; 32],
}

impl fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiToken")
            .field("name", &self.name)
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

/// The tokens of `tokens_file`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ApiTokens(Vec<ApiToken>);

/// What a new token's secret starts with, so a leaked one is recognised
/// (secret scanners, logs).
pub const TOKEN_PREFIX: &str = "clt_";

impl ApiTokens {
    /// The token whose secret `presented` is, compared in constant time
    /// against every token (no early return: how long it takes tells
    /// nothing of which digest matched, or how much of one).
    pub fn verify(&self, presented: &str) -> Option<&ApiToken> {
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        let mut found = None;
        for token in &self.0 {
            let same = token
                .digest
                .iter()
                .zip(digest.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b));
            if same == 0 {
                found = Some(token);
            }
        }
        found
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A new token for `name`: its secret (shown once) and the `[[token]]`
/// table that goes into `tokens_file`.
pub fn new_token(name: &str, scope: Scope) -> Result<(String, String), String> {
    token_name(name)?;
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness: {e}"))?;
    let secret = format!("{TOKEN_PREFIX}{}", hex(&bytes));
    let digest = hex(&Sha256::digest(secret.as_bytes()));
    let table = format!(
        "[[token]]\nname = \"{name}\"\nscope = \"{}\"\nsha256 = \"{digest}\"\n",
        scope.as_str()
    );
    Ok((secret, table))
}

/// `message` with every token secret (`clt_` and what follows it) and
/// every quoted value replaced: what serde quotes from a tokens file.
pub fn redact_secrets(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find(TOKEN_PREFIX) {
        out.push_str(&rest[..at]);
        out.push_str("clt_<redacted>");
        let tail = &rest[at + TOKEN_PREFIX.len()..];
        let end = tail
            .find(|c: char| !c.is_ascii_alphanumeric())
            .unwrap_or(tail.len());
        rest = &tail[end..];
    }
    out.push_str(rest);
    // Quoted values (`invalid type: string "..."`, `unknown variant `...``).
    let mut clean = String::with_capacity(out.len());
    let mut quoted = None;
    for c in out.chars() {
        match quoted {
            Some(q) if c == q => {
                clean.push('…');
                clean.push(c);
                quoted = None;
            }
            Some(_) => {}
            None if c == '"' || c == '`' => {
                clean.push(c);
                quoted = Some(c);
            }
            None => clean.push(c),
        }
    }
    if quoted.is_some() {
        clean.push('…');
    }
    clean
}

/// `bytes` as lower-case hex digits (digests, signatures).
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

fn token_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '@'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "invalid token name {name:?}: expected 1 to 64 characters from [A-Za-z0-9_.@-]"
        ))
    }
}

/// The listener's TLS: the files, and the server configuration read from
/// them. Equal when the files' paths and contents are.
#[derive(Clone)]
pub struct HttpTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub server: Arc<rustls::ServerConfig>,
    /// SHA-256 of the certificate chain and the key as read, to tell a
    /// reload that replaced them.
    read: [u8; 32],
}

impl fmt::Debug for HttpTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpTls")
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .finish_non_exhaustive()
    }
}

impl PartialEq for HttpTls {
    fn eq(&self, other: &Self) -> bool {
        self.cert_file == other.cert_file
            && self.key_file == other.key_file
            && self.read == other.read
    }
}

/// Who may use the `[http]` listener, and over what.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HttpAccess {
    /// `tokens_file`, loaded. `None`: no tokens, the API is read-only.
    pub tokens: Option<Arc<ApiTokens>>,
    /// `require_token_for_read`: `/api/*` and `/metrics` need a token
    /// (`read` or `operate`) too.
    pub read_requires_token: bool,
    pub tls: Option<HttpTls>,
}

/// `[http]`'s access settings, files read relative to `base`.
pub(super) fn http_access(
    src: &Source,
    raw: &RawConfig,
    base: &Path,
    errors: &mut Vec<ConfigError>,
    warnings: &mut Vec<String>,
) -> HttpAccess {
    let Some(http) = raw.http.as_ref().or(raw.metrics.as_ref()) else {
        return HttpAccess::default();
    };
    let tokens = http
        .tokens_file
        .as_ref()
        .and_then(|f| tokens_file(src, f, base, errors, warnings))
        .map(Arc::new);
    let read_requires_token = http.require_token_for_read.as_ref().is_some_and(|r| {
        let on = *r.get_ref();
        if on && tokens.is_none() && http.tokens_file.is_none() {
            errors.push(src.at(
                r,
                "http.require_token_for_read needs http.tokens_file: without tokens nobody could read",
            ));
        }
        on
    });
    let tls = match (&http.tls_cert_file, &http.tls_key_file) {
        (None, None) => None,
        (Some(c), None) => {
            errors.push(src.at(c, "http.tls_cert_file needs http.tls_key_file"));
            None
        }
        (None, Some(k)) => {
            errors.push(src.at(k, "http.tls_key_file needs http.tls_cert_file"));
            None
        }
        (Some(c), Some(k)) => tls_files(src, c, k, base, errors),
    };
    HttpAccess {
        tokens,
        read_requires_token,
        tls,
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTokensFile {
    #[serde(default)]
    token: Vec<RawToken>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawToken {
    name: Spanned<String>,
    scope: Spanned<Scope>,
    sha256: Spanned<String>,
}

fn tokens_file(
    src: &Source,
    file: &Spanned<String>,
    base: &Path,
    errors: &mut Vec<ConfigError>,
    warnings: &mut Vec<String>,
) -> Option<ApiTokens> {
    let path = base.join(file.get_ref());
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => {
            errors.push(src.at(
                file,
                format!("cannot read http.tokens_file {}: {e}", path.display()),
            ));
            return None;
        }
    };
    {
        use std::os::unix::fs::PermissionsExt;
        if std::fs::metadata(&path).is_ok_and(|m| m.permissions().mode() & 0o004 != 0) {
            warnings.push(format!(
                "http.tokens_file {} is readable by every user: its digests let anyone try guesses offline; chmod 600 it",
                path.display()
            ));
        }
    }
    let tokens_src = Source::new(path.display().to_string(), text);
    let before = errors.len();
    let parsed: Option<RawTokensFile> = parse_toml(&tokens_src, errors);
    // serde quotes the value it could not take: a secret pasted into the
    // file (in place of its digest, or as a stray key) must not reach
    // `check`'s output or the journal.
    for e in &mut errors[before..] {
        e.message = redact_secrets(&e.message);
    }
    let raw = parsed?;
    let mut seen = std::collections::HashSet::new();
    let mut tokens = Vec::new();
    let mut digests = std::collections::HashSet::new();
    for t in raw.token {
        let name = t.name.get_ref();
        if let Err(m) = token_name(name) {
            errors.push(tokens_src.at(&t.name, m));
        } else if !seen.insert(name.clone()) {
            errors.push(tokens_src.at(&t.name, format!("token {name:?} is defined twice")));
        }
        let digest = t.sha256.get_ref();
        let bytes: Option<Vec<u8>> = (digest.len() == 64
            && digest.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| {
            (0..32)
                .map(|i| u8::from_str_radix(digest.get(2 * i..2 * i + 2)?, 16).ok())
                .collect()
        })
        .flatten();
        match bytes.and_then(|b| <[u8; 32]>::try_from(b).ok()) {
            Some(digest) => {
                if !digests.insert(digest) {
                    errors.push(tokens_src.at(
                        &t.sha256,
                        "this sha256 is another token's too: each token needs a secret of its own",
                    ));
                }
                tokens.push(ApiToken {
                    name: name.clone(),
                    scope: *t.scope.get_ref(),
                    digest,
                });
            }
            None => errors.push(tokens_src.at(
                &t.sha256,
                "sha256 must be 64 hex digits: the SHA-256 of the token's secret (`cronlease token NAME` makes both)",
            )),
        }
    }
    (errors.len() == before).then_some(ApiTokens(tokens))
}

fn tls_files(
    src: &Source,
    cert: &Spanned<String>,
    key: &Spanned<String>,
    base: &Path,
    errors: &mut Vec<ConfigError>,
) -> Option<HttpTls> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let (cert_file, key_file) = (base.join(cert.get_ref()), base.join(key.get_ref()));
    let read =
        |spanned: &Spanned<String>, path: &Path, what: &str, errors: &mut Vec<ConfigError>| {
            std::fs::read(path)
                .map_err(|e| {
                    errors.push(src.at(
                        spanned,
                        format!("cannot read http.{what} {}: {e}", path.display()),
                    ))
                })
                .ok()
        };
    let cert_pem = read(cert, &cert_file, "tls_cert_file", errors)?;
    let key_pem = read(key, &key_file, "tls_key_file", errors)?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<_, _>>()
        .unwrap_or_default();
    if chain.is_empty() {
        errors.push(src.at(
            cert,
            format!(
                "http.tls_cert_file {}: no PEM certificate in it",
                cert_file.display()
            ),
        ));
        return None;
    }
    // Never the key's bytes in a message: only that it is not one.
    let Ok(private) = PrivateKeyDer::from_pem_slice(&key_pem) else {
        errors.push(src.at(
            key,
            format!(
                "http.tls_key_file {}: no PEM private key in it (PKCS#8, PKCS#1 or SEC1)",
                key_file.display()
            ),
        ));
        return None;
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(chain, private));
    let mut server = match server {
        Ok(s) => s,
        Err(e) => {
            errors.push(src.at(
                cert,
                format!(
                    "http.tls_cert_file {} and tls_key_file {}: {e}",
                    cert_file.display(),
                    key_file.display()
                ),
            ));
            return None;
        }
    };
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    let mut hasher = Sha256::new();
    hasher.update(&cert_pem);
    hasher.update(&key_pem);
    Some(HttpTls {
        cert_file,
        key_file,
        server: Arc::new(server),
        read: hasher.finalize().into(),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_new_token_verifies_against_its_table_and_nothing_else_does() {
        let (secret, table) = new_token("ci", Scope::Operate).unwrap();
        assert!(secret.starts_with(TOKEN_PREFIX) && secret.len() == TOKEN_PREFIX.len() + 64);
        let src = Source::new("tokens.toml".into(), table.clone());
        let mut errors = Vec::new();
        let raw: RawTokensFile = parse_toml(&src, &mut errors).unwrap();
        let digest = raw.token[0].sha256.get_ref().clone();
        assert!(!table.contains(&secret), "the table keeps no secret");
        let mut bytes = [0u8; 32];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&digest[2 * i..2 * i + 2], 16).unwrap();
        }
        let tokens = ApiTokens(vec![
            ApiToken {
                name: "other".into(),
                scope: Scope::Read,
                digest: Sha256::digest(b"clt_other").into(),
            },
            ApiToken {
                name: "ci".into(),
                scope: Scope::Operate,
                digest: bytes,
            },
        ]);
        let found = tokens.verify(&secret).unwrap();
        assert_eq!((found.name.as_str(), found.scope), ("ci", Scope::Operate));
        assert_eq!(tokens.verify("clt_other").unwrap().name, "other");
        assert!(tokens.verify(&secret[..secret.len() - 1]).is_none());
        assert!(tokens.verify("").is_none());
        assert!(new_token("no spaces", Scope::Read).is_err());
        // A secret pasted into the file is never quoted back.
        for text in [
            format!("token = \"{secret}\"\n"),
            format!("[[token]]\nname = \"x\"\nscope = \"{secret}\"\nsha256 = \"{digest}\"\n"),
            format!("[[token]]\nname = \"x\"\nscope = \"read\"\nsha256 = \"{secret}\"\n"),
            format!("{secret} = 1\n"),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let file = dir.path().join("tokens.toml");
            std::fs::write(&file, &text).unwrap();
            let main = Source::new("main.toml".into(), "x = \"tokens.toml\"".into());
            let spanned: Spanned<String> = toml::from_str::<
                std::collections::BTreeMap<String, Spanned<String>>,
            >("x = \"tokens.toml\"")
            .unwrap()
            .remove("x")
            .unwrap();
            let (mut errors, mut warnings) = (Vec::new(), Vec::new());
            assert!(tokens_file(&main, &spanned, dir.path(), &mut errors, &mut warnings).is_none());
            assert!(!errors.is_empty(), "{text}");
            let shown: String = errors.iter().map(|e| e.to_string()).collect();
            assert!(!shown.contains(&secret[4..]), "{shown}");
        }
        assert!(Scope::Operate > Scope::Read);
    }
}
