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

use std::collections::VecDeque;

/// Bytes kept beyond `output_tail` until the run ends, for secrets cut in
/// two by the first cut (a password up to this long).
pub const SLACK: usize = 4096;

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
}
