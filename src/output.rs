//! The output tail a run leaves in history (`output_tail`): the last bytes
//! of its stdout and stderr, in the order their lines came, as UTF-8 text
//! with no secret in it.
//!
//! [`Tail`] keeps the last `output_tail` bytes plus [`SLACK`] as they come
//! (a run writing a gigabyte costs the buffer, not the gigabyte). When the
//! run ends, [`Tail::finish`] turns them into text: a cut that fell inside a
//! character drops that character's remaining bytes, invalid UTF-8 becomes
//! U+FFFD, the store's password (from its URL or `password_file`) becomes
//! `***`, and the text is cut to at most `output_tail` bytes at a character
//! boundary. A password the first cut split in two is no longer a password
//! `scrub` can find: so after a cut the first line is dropped whole (or,
//! with no line end in the first [`SLACK`] bytes, those bytes), and the end
//! of a secret the cut left there goes with it.

//!
//! [`LogLines`] cuts the same streams into the daemon's log events: a line
//! each, a line longer than [`MAX_LINE`] in pieces, each cut where it splits
//! no secret, so that `scrub` finds every one whole in its event.

use std::collections::VecDeque;

/// Longest output line logged as one event; longer lines are logged in
/// pieces of at most this many bytes (plus a held-back secret's length).
pub const MAX_LINE: usize = 16 * 1024;

/// Bytes kept beyond `output_tail` until the run ends, for secrets cut in
/// two by the first cut (a password up to this long).
pub const SLACK: usize = 4096;

/// Cuts a run's output stream into log events ([`MAX_LINE`]): each event is
/// one line without its line end, or a piece of a longer line. A piece
/// ends at least a secret's length short of [`MAX_LINE`], and never inside
/// a secret: what it leaves starts the next piece. The events are raw bytes;
/// the caller scrubs them.
#[derive(Debug)]
pub struct LogLines {
    max: usize,
    /// Each form a secret may take in the output, as bytes.
    secrets: Vec<Vec<u8>>,
    buf: Vec<u8>,
    /// The first bytes of `buf` known to hold no line end.
    scanned: usize,
}

impl LogLines {
    /// A splitter keeping `secrets` (each in every form it may be written
    /// in) whole.
    pub fn new(secrets: Vec<String>) -> LogLines {
        LogLines::with_max(MAX_LINE, secrets)
    }

    fn with_max(max: usize, secrets: Vec<String>) -> LogLines {
        LogLines {
            max,
            secrets: secrets
                .into_iter()
                .filter(|s| !s.is_empty())
                .map(String::into_bytes)
                .collect(),
            buf: Vec::new(),
            scanned: 0,
        }
    }

    /// Adds what the stream gave next; returns the events it completed.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<Vec<u8>> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        loop {
            let window = self.buf.len().min(self.max);
            let newline = self.buf[self.scanned.min(window)..window]
                .iter()
                .position(|b| *b == b'\n');
            if let Some(at) = newline {
                let end = self.scanned.min(window) + at;
                let mut event: Vec<u8> = self.buf.drain(..=end).collect();
                trim_line_end(&mut event);
                events.push(event);
                self.scanned = 0;
            } else if self.buf.len() >= self.max {
                let cut = self.piece_end();
                events.push(self.buf.drain(..cut).collect());
                self.scanned = 0;
            } else {
                self.scanned = window;
                return events;
            }
        }
    }

    /// The rest when the stream ends.
    pub fn finish(&mut self) -> Option<Vec<u8>> {
        let mut event = std::mem::take(&mut self.buf);
        self.scanned = 0;
        trim_line_end(&mut event);
        (!event.is_empty()).then_some(event)
    }

    /// Where a piece of an overlong line ends: a secret's length (less one)
    /// short of `max`, so a secret starting there waits for its end, and
    /// earlier still if a secret spans that point.
    fn piece_end(&self) -> usize {
        let longest = self.secrets.iter().map(Vec::len).max().unwrap_or(0);
        let mut cut = self.max.saturating_sub(longest.saturating_sub(1));
        loop {
            let spanning = self
                .secrets
                .iter()
                .filter_map(|secret| {
                    let from = cut.saturating_sub(secret.len().saturating_sub(1));
                    (from..cut).find(|&start| {
                        start + secret.len() > cut && self.buf[start..].starts_with(secret)
                    })
                })
                .min();
            match spanning {
                Some(start) => cut = start,
                None => break,
            }
        }
        // A piece of nothing but a secret cannot be: the output goes on.
        if cut == 0 { self.max } else { cut }
    }
}

/// A log event's text with every control character but tab escaped as in
/// Rust (`\0` as `\u{0}`, a bare CR as `\r`, ESC as `\u{1b}`): a job's
/// bytes cannot truncate a line of the text log, overwrite it on a
/// terminal, or send a terminal escape sequence.
pub fn escape_controls(text: &str) -> std::borrow::Cow<'_, str> {
    let control = |c: char| c.is_control() && c != '\t';
    if !text.chars().any(control) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if control(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

fn trim_line_end(line: &mut Vec<u8>) {
    while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        line.pop();
    }
}

/// Longest excerpt `history` shows of a tail, in characters.
const EXCERPT: usize = 60;

/// The last bytes a run wrote to stdout and stderr.
#[derive(Debug)]
pub struct Tail {
    keep: usize,
    buf: VecDeque<u8>,
    /// Bytes were dropped from the front: the buffer may start mid-character.
    cut: bool,
}

impl Tail {
    /// A tail keeping `keep` bytes (0: nothing).
    pub fn new(keep: usize) -> Tail {
        Tail {
            keep,
            buf: VecDeque::new(),
            cut: false,
        }
    }

    fn capacity(&self) -> usize {
        if self.keep == 0 {
            0
        } else {
            self.keep.saturating_add(SLACK)
        }
    }

    /// Adds what the run wrote next.
    pub fn push(&mut self, bytes: &[u8]) {
        let cap = self.capacity();
        if bytes.is_empty() {
            return;
        }
        if bytes.len() >= cap {
            self.cut |= !self.buf.is_empty() || bytes.len() > cap;
            self.buf.clear();
            self.buf.extend(&bytes[bytes.len() - cap..]);
            return;
        }
        let over = (self.buf.len() + bytes.len()).saturating_sub(cap);
        if over > 0 {
            self.buf.drain(..over);
            self.cut = true;
        }
        self.buf.extend(bytes);
    }

    /// The tail as history keeps it, with `scrub` removing secrets.
    pub fn finish(&self, scrub: impl Fn(&str) -> String) -> String {
        if self.keep == 0 || self.buf.is_empty() {
            return String::new();
        }
        let bytes: Vec<u8> = self.buf.iter().copied().collect();
        let text = scrub(&text_of(&bytes, self.cut));
        let text = match self.cut {
            true => after_first_line(&text),
            false => &text,
        };
        last_bytes(text, self.keep).to_string()
    }
}

/// `text` without its first line (up to and with its `\n`), which a cut
/// may have started inside of; with no `\n` in the first [`SLACK`] bytes,
/// without those bytes.
fn after_first_line(text: &str) -> &str {
    let head = last_bytes_from(text, SLACK.min(text.len()));
    match text[..head].find('\n') {
        Some(i) => &text[i + 1..],
        None => &text[head..],
    }
}

/// The first character boundary of `text` at or after `at`.
fn last_bytes_from(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at += 1;
    }
    at
}

/// `bytes` as text: invalid UTF-8 as U+FFFD, and when they are the end of
/// something longer (`cut`), without the continuation bytes of a character
/// whose first byte was cut away (a character has at most three).
fn text_of(bytes: &[u8], cut: bool) -> std::borrow::Cow<'_, str> {
    let start = match cut {
        true => bytes
            .iter()
            .take(4)
            .position(|b| b & 0xC0 != 0x80)
            .unwrap_or(0),
        false => 0,
    };
    String::from_utf8_lossy(&bytes[start..])
}

/// The end of `text`, at most `keep` bytes, starting at a character.
fn last_bytes(text: &str, keep: usize) -> &str {
    if text.len() <= keep {
        return text;
    }
    &text[last_bytes_from(text, text.len() - keep)..]
}

/// One line of a tail for `history`: its last line with text, control
/// characters shown as spaces, at most [`EXCERPT`] characters (the end
/// of a longer one, after `…`).
pub fn excerpt(tail: &str) -> String {
    let Some(line) = tail.lines().rev().find(|l| !l.trim().is_empty()) else {
        return String::new();
    };
    let clean: String = line
        .trim()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let count = clean.chars().count();
    if count <= EXCERPT {
        return clean;
    }
    let rest: String = clean.chars().skip(count - (EXCERPT - 1)).collect();
    format!("…{rest}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keep_all(t: &str) -> String {
        t.to_string()
    }

    #[test]
    fn keeps_only_the_last_bytes_of_a_long_output() {
        let mut tail = Tail::new(8);
        for chunk in [b"first line\n".as_slice(), b"second\n", b"third\n"] {
            tail.push(chunk);
        }
        assert_eq!(tail.finish(keep_all), "d\nthird\n");
        let mut big = Tail::new(1024);
        for _ in 0..1024 {
            big.push(&[b'x'; 1024]);
        }
        big.push(b"end\n");
        let out = big.finish(keep_all);
        assert_eq!(out.len(), 1024);
        assert!(out.ends_with("xend\n"));
        assert!(big.buf.len() <= 1024 + SLACK);
    }

    #[test]
    fn a_cut_never_splits_a_character_and_invalid_bytes_become_replacements() {
        // "é" is two bytes; a cut keeping 3 bytes of "aéé" starts inside the
        // first é's bytes only once the slack is used up, so check both
        // helpers directly.
        assert_eq!(last_bytes("aéé", 3), "é");
        assert_eq!(last_bytes("aéé", 4), "éé");
        let mut tail = Tail::new(4);
        tail.push(&[b'a'; SLACK]);
        tail.push("€€".as_bytes()); // 3 bytes each
        let out = tail.finish(keep_all);
        assert_eq!(out, "€");
        // The first cut left the last two bytes of "€" (E2 82 AC).
        let mut cut_inside = Tail::new(1);
        cut_inside.push("€".as_bytes());
        cut_inside.push(&[b'z'; SLACK - 1]);
        assert!(cut_inside.cut && cut_inside.buf.front() == Some(&0x82));
        assert_eq!(text_of(&[0x82, 0xAC, b'o', b'k'], true), "ok");
        assert_eq!(
            text_of(&[0x82, 0xAC, b'o', b'k'], false),
            "\u{fffd}\u{fffd}ok"
        );
        let mut bad = Tail::new(64);
        bad.push(b"caf\xc3 \xff\xfe end");
        assert_eq!(bad.finish(keep_all), "caf\u{fffd} \u{fffd}\u{fffd} end");
    }

    #[test]
    fn a_secret_is_removed_even_when_the_first_cut_split_it() {
        let scrub = |t: &str| t.replace("hunter2-secret", "***");
        let mut tail = Tail::new(8);
        let mut text = vec![b'.'; SLACK];
        text.extend(b"hunter2-secret\nok\n");
        tail.push(&text);
        // The last 8 bytes as written hold the secret's end ("cret\nok\n");
        // it is removed before the cut.
        let out = tail.finish(scrub);
        assert!(!out.contains("cret"), "{out:?}");
        assert_eq!(out, "ok\n");
        let mut whole = Tail::new(100);
        whole.push(b"password: hunter2-secret\n");
        assert_eq!(whole.finish(scrub), "password: ***\n");
    }

    /// Every line holds the secret, and scrubbing shrinks each: the text
    /// left after the scrub reaches back to the buffer's start, where the
    /// cut left the end of one secret. No 8 characters of it remain.
    #[test]
    fn no_fragment_of_a_secret_survives_a_cut_inside_it() {
        let secret = "abcdefghijklmnopqrstuvwx";
        let scrub = |t: &str| t.replace(secret, "***");
        for shift in 0..45 {
            // 45-byte lines, then `shift` more bytes: the first cut falls
            // at every offset of a line, inside the secret for 24 of them.
            let mut tail = Tail::new(8 * 1024);
            for _ in 0..400 {
                tail.push(format!("postgres://app:{secret}@db/x\n").as_bytes());
            }
            tail.push(&vec![b'-'; shift]);
            let out = tail.finish(scrub);
            for w in secret.as_bytes().windows(8) {
                let piece = std::str::from_utf8(w).unwrap_or_default();
                assert!(!out.contains(piece), "shift {shift}: {piece:?} in the tail");
            }
            assert!(out.contains("postgres://app:***@db/x\n"));
        }
        // No line end near the start: the first SLACK bytes go.
        let mut one_line = Tail::new(16);
        one_line.push(&[b'y'; 3 * SLACK]);
        assert_eq!(one_line.finish(keep_all), "y".repeat(16));
    }

    #[test]
    fn nothing_is_kept_with_a_tail_of_zero() {
        let mut tail = Tail::new(0);
        tail.push(b"anything\n");
        assert_eq!(tail.finish(keep_all), "");
        assert!(tail.buf.is_empty());
    }

    #[test]
    fn an_excerpt_is_the_last_line_with_text() {
        assert_eq!(excerpt("one\ntwo\n\n  \n"), "two");
        assert_eq!(excerpt(""), "");
        assert_eq!(excerpt("a\tb\r\n"), "a b");
        let long = "x".repeat(100) + "END";
        let e = excerpt(&long);
        assert_eq!(e.chars().count(), EXCERPT);
        assert!(e.starts_with('…') && e.ends_with("END"), "{e}");
    }

    /// A line longer than the limit with the password anywhere across the
    /// first cut (the issue: 16,380 bytes and the password, logged as
    /// `…S3cr` and `3tPassw0rdXYZ`): every event scrubbed holds no piece of
    /// it, in whatever chunks the stream comes, and nothing is lost.
    #[test]
    fn no_log_event_holds_a_piece_of_a_secret_at_any_cut_offset() {
        let secret = "S3cr3t p@ssw0rdXYZ";
        let encoded = "S3cr3t+p%40ssw0rdXYZ";
        let scrub = |t: &str| t.replace(secret, "***").replace(encoded, "***");
        for written in [secret, encoded] {
            for before in MAX_LINE - 3 * written.len()..=MAX_LINE + 2 {
                for chunk in [8192, 1000, 7] {
                    let mut input = vec![b'x'; before];
                    input.extend(written.as_bytes());
                    input.extend(b"yy\nnext line\n");
                    let mut lines = LogLines::new(vec![secret.into(), encoded.into()]);
                    let mut events = Vec::new();
                    for piece in input.chunks(chunk) {
                        events.extend(lines.push(piece));
                    }
                    events.extend(lines.finish());
                    let raw: Vec<u8> = events.concat();
                    let mut whole = input.clone();
                    whole.retain(|b| *b != b'\n');
                    assert_eq!(raw, whole, "nothing lost at {before}, chunks of {chunk}");
                    for event in &events {
                        assert!(event.len() <= MAX_LINE, "{} bytes", event.len());
                        let text = scrub(&String::from_utf8_lossy(event));
                        for piece in written.as_bytes().windows(3) {
                            let piece = String::from_utf8_lossy(piece);
                            assert!(
                                !text.contains(piece.as_ref()),
                                "{piece:?} of the secret in an event at offset {before}, chunks of {chunk}: ...{}",
                                &text[text.len().saturating_sub(40)..]
                            );
                        }
                    }
                    assert_eq!(events.last().map(Vec::as_slice), Some(&b"next line"[..]));
                }
            }
        }
    }

    /// Lines are events without their line ends; a long line without a
    /// secret is cut at the limit exactly; the rest at the end is one event.
    #[test]
    fn log_lines_are_lines_and_long_ones_are_cut_at_the_limit() {
        let mut lines = LogLines::with_max(8, vec![]);
        assert_eq!(
            lines.push(b"ab\r\ncd\n0123456789"),
            vec![b"ab".to_vec(), b"cd".to_vec(), b"01234567".to_vec()]
        );
        assert_eq!(lines.push(b"xx"), Vec::<Vec<u8>>::new());
        assert_eq!(lines.finish(), Some(b"89xx".to_vec()));
        assert_eq!(lines.finish(), None);
        // With a secret of 4 bytes, a piece ends 3 bytes short of the limit,
        // or before a secret that spans that point.
        let mut held = LogLines::with_max(8, vec!["abcd".into()]);
        assert_eq!(held.push(b"0123456789"), vec![b"01234".to_vec()]);
        let mut spanning = LogLines::with_max(8, vec!["abcd".into()]);
        assert_eq!(spanning.push(b"0123abcd99"), vec![b"0123".to_vec()]);
        assert_eq!(spanning.finish(), Some(b"abcd99".to_vec()));
    }

    #[test]
    fn control_characters_are_escaped_for_the_log() {
        assert_eq!(escape_controls("plain\ttext é"), "plain\ttext é");
        assert_eq!(
            escape_controls("nul:\0:cr:\r:esc:\u{1b}[31m"),
            "nul:\\u{0}:cr:\\r:esc:\\u{1b}[31m"
        );
    }
}
