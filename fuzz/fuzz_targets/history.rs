//! History rows as each backend family decodes them, then shown as
//! `cronlease history` shows them (its JSON and its table's cells).
//!
//! Input: one byte for the family, then the reply:
//! - `j`: a ZooKeeper or etcd history entry (its stored JSON);
//! - `r`: a Redis run stream's `XREVRANGE` reply (RESP bytes);
//! - `s`: a SQL history row, one column a line: `n` (NULL integer), `N`
//!   (NULL text), `b 0|1`, `s`/`i`/`l` INT (16, 32, 64 bits), `r`/`d` FLOAT
//!   (32, 64 bits), `t TEXT`, `x BYTES` (a blob).
//!
//! Property: no panic. A row this version cannot read is a malformed run
//! (key-value stores, Redis) or an error (SQL), never a crash.

#![no_main]

use chrono::SecondsFormat;
use cronlease::fuzzing::{self, SqlValue};
use cronlease::store::RunRecord;
use libfuzzer_sys::fuzz_target;

/// The number after a column line's tag.
fn number<T: std::str::FromStr>(line: &[u8]) -> Option<T> {
    std::str::from_utf8(line.get(2..)?)
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// One SQL column from its line; a number that does not parse is text.
fn sql_value(line: &[u8]) -> SqlValue {
    let rest = line.get(2..).unwrap_or_default();
    let text = || SqlValue::Text(String::from_utf8_lossy(rest).into_owned());
    match line.first() {
        Some(b'n') => SqlValue::Null,
        Some(b'N') => SqlValue::NullText,
        Some(b'b') => SqlValue::Bool(rest.first() == Some(&b'1')),
        Some(b's') => number(line).map_or_else(text, SqlValue::SmallInt),
        Some(b'i') => number(line).map_or_else(text, SqlValue::Integer),
        Some(b'l') => number(line).map_or_else(text, SqlValue::BigInt),
        Some(b'r') => number(line).map_or_else(text, SqlValue::Real),
        Some(b'd') => number(line).map_or_else(text, SqlValue::Double),
        Some(b'x') => SqlValue::Blob(rest.to_vec()),
        _ => text(),
    }
}

/// What `history` prints of the runs.
fn show(runs: &[RunRecord]) {
    let _ = serde_json::to_string_pretty(runs);
    for r in runs {
        let _ = r.occurrence.to_rfc3339_opts(SecondsFormat::Secs, true);
        let _ = format!("{:.3}s", r.delay_ms as f64 / 1000.0);
        let _ = format!(
            "{:.3}s",
            (r.finished_at - r.started_at).num_milliseconds() as f64 / 1000.0
        );
        let _ = match r.exit_code {
            Some(c) => format!("{} ({c})", r.outcome),
            None => r.outcome.to_string(),
        };
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&family, reply)) = data.split_first() else {
        return;
    };
    let runs = match family {
        b'j' => vec![fuzzing::kv_history_entry(
            "00000000000000000042",
            reply,
            1_780_000_000_000,
        )],
        b'r' => match fuzzing::redis_history_reply(reply) {
            Some(Ok(runs)) => runs,
            Some(Err(_)) | None => return,
        },
        b's' => {
            let row = reply.split(|&b| b == b'\n').map(sql_value).collect();
            match fuzzing::sql_history_row(row) {
                Ok(run) => vec![run],
                Err(_) => return,
            }
        }
        _ => return,
    };
    show(&runs);
});
