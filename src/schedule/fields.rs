//! The fields of a cron schedule read as cron reads them (numbers, names,
//! ranges, steps, lists): `import-crontab` translates a crontab's fields
//! with them, and a job file's schedule that croner refuses is explained
//! in their words ("hour 61 is out of range: expected a number from 0 to
//! 23"); croner's own ("Number out of bounds") name no field and no range.

/// The five fields' readings: what they are called, their range, names.
pub(crate) struct Spec {
    what: &'static str,
    lo: u32,
    hi: u32,
    names: &'static [&'static str],
    /// The value of `names[0]`.
    first_name: u32,
    expected: &'static str,
}

const MONTHS: [&str; 12] = [
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
];
const DAYS: [&str; 7] = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"];

pub(crate) const SPECS: [Spec; 5] = [
    Spec {
        what: "minute",
        lo: 0,
        hi: 59,
        names: &[],
        first_name: 0,
        expected: "a number from 0 to 59",
    },
    Spec {
        what: "hour",
        lo: 0,
        hi: 23,
        names: &[],
        first_name: 0,
        expected: "a number from 0 to 23",
    },
    Spec {
        what: "day of month",
        lo: 1,
        hi: 31,
        names: &[],
        first_name: 0,
        expected: "a number from 1 to 31",
    },
    Spec {
        what: "month",
        lo: 1,
        hi: 12,
        names: &MONTHS,
        first_name: 1,
        expected: "a number from 1 to 12 or a name jan to dec",
    },
    Spec {
        what: "day of week",
        lo: 0,
        hi: 7,
        names: &DAYS,
        first_name: 0,
        expected: "a number from 0 to 7 (0 and 7 are Sunday) or a name sun to sat",
    },
];

/// One field, read: its text for the schedule (numbers only), the values it
/// matches, and whether it starts with `*` (cron's test for the day rule).
pub(crate) struct Field {
    pub(crate) text: String,
    pub(crate) bits: u64,
    pub(crate) star: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Star,
    Range,
    Single,
}

/// A field error: byte offset in the line, message.
pub(crate) type FieldError = (usize, String);

impl Spec {
    fn is_day_of_week(&self) -> bool {
        self.hi == 7
    }

    fn bit(&self, v: u32) -> u64 {
        // 7 is Sunday, as 0 is.
        let v = if self.is_day_of_week() && v == 7 {
            0
        } else {
            v
        };
        1u64 << v
    }

    pub(crate) fn full(&self) -> u64 {
        (self.lo..=self.hi).fold(0, |m, v| m | self.bit(v))
    }

    /// One value: a number, or a name where the field has names.
    fn value(&self, s: &str, at: usize, range_end: bool) -> Result<u32, FieldError> {
        if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
            return s
                .parse::<u32>()
                .ok()
                .filter(|v| (self.lo..=self.hi).contains(v))
                .ok_or_else(|| {
                    (
                        at,
                        format!(
                            "{} {s} is out of range: expected {}",
                            self.what, self.expected
                        ),
                    )
                });
        }
        if !self.names.is_empty() && !s.is_empty() && s.chars().all(|c| c.is_ascii_alphabetic()) {
            return match self.names.iter().position(|n| n.eq_ignore_ascii_case(s)) {
                // `fri-sun`: Sunday closing a range is the 7, so the
                // weekend reads as it was meant.
                Some(0) if self.is_day_of_week() && range_end => Ok(7),
                Some(i) => Ok(self.first_name + i as u32),
                None => Err((
                    at,
                    format!(
                        "unknown {} name {s:?}: expected {}",
                        self.what, self.expected
                    ),
                )),
            };
        }
        Err((
            at,
            format!(
                "expected {} for the {}, found {s:?}",
                self.expected, self.what
            ),
        ))
    }

    /// A whole field starting at byte `at` of its line.
    pub(crate) fn parse(&self, s: &str, at: usize) -> Result<Field, FieldError> {
        let items: Vec<&str> = s.split(',').collect();
        let mut out = Vec::with_capacity(items.len());
        let mut bits = 0u64;
        let mut offset = at;
        for item in &items {
            let item_at = offset;
            offset += item.len() + 1;
            if item.is_empty() {
                return Err((
                    item_at,
                    format!(
                        "expected a {} value, range or * on each side of every comma",
                        self.what
                    ),
                ));
            }
            let (range, step) = match item.split_once('/') {
                Some((r, st)) => (r, Some((st, item_at + r.len() + 1))),
                None => (*item, None),
            };
            let (a, b, kind) = if range == "*" {
                (self.lo, self.hi, Kind::Star)
            } else if let Some((x, y)) = range.split_once('-') {
                let a = self.value(x, item_at, false)?;
                let b = self.value(y, item_at + x.len() + 1, true)?;
                if a > b {
                    return Err((
                        item_at,
                        format!(
                            "{} range {range} runs backwards: expected the smaller value first",
                            self.what
                        ),
                    ));
                }
                (a, b, Kind::Range)
            } else {
                let v = self.value(range, item_at, false)?;
                (v, v, Kind::Single)
            };
            let step = match step {
                None => 1,
                Some((st, st_at)) => {
                    if kind == Kind::Single {
                        // Vixie cron ignores such a step, cronie reads it as
                        // a range to the maximum: no reading is safe.
                        return Err((
                            item_at,
                            format!(
                                "{item}: a step needs a range or *: write {range}-{}/{st} or */{st}",
                                self.hi
                            ),
                        ));
                    }
                    let max = self.hi - self.lo + 1;
                    match st.parse::<u32>() {
                        Ok(v)
                            if st.bytes().all(|b| b.is_ascii_digit()) && (1..=max).contains(&v) =>
                        {
                            v
                        }
                        _ => {
                            return Err((
                                st_at,
                                format!(
                                    "expected a step from 1 to {max} after the /, found {st:?}"
                                ),
                            ));
                        }
                    }
                }
            };
            let mut v = a;
            while v <= b {
                bits |= self.bit(v);
                v += step;
            }
            out.push(match (kind, step) {
                (Kind::Star, 1) if items.len() == 1 => "*".to_string(),
                // croner takes `*` only as a whole field.
                (Kind::Star, 1) => format!("{}-{}", self.lo, self.hi),
                (Kind::Star, s) => format!("*/{s}"),
                (Kind::Range, 1) => format!("{a}-{b}"),
                (Kind::Range, s) => format!("{a}-{b}/{s}"),
                (Kind::Single, _) => a.to_string(),
            });
        }
        Ok(Field {
            text: out.join(","),
            bits,
            star: s.starts_with('*'),
        })
    }
}

/// The seconds field a 6-field schedule starts with.
const SECOND: Spec = Spec {
    what: "second",
    lo: 0,
    hi: 59,
    names: &[],
    first_name: 0,
    expected: "a number from 0 to 59",
};

/// The spec of field `index` of a schedule of `count` fields (5: minute
/// first; 6: second first).
fn spec_of(index: usize, count: usize) -> Option<&'static Spec> {
    match (count, index) {
        (6, 0) => Some(&SECOND),
        (6, i) => SPECS.get(i - 1),
        (5, i) => SPECS.get(i),
        _ => None,
    }
}

/// What field `index` of a schedule of `count` fields is called.
pub(crate) fn field_name(index: usize, count: usize) -> &'static str {
    spec_of(index, count).map_or("field", |s| s.what)
}

/// Why `text`, field `index` of a schedule of `count` fields, is wrong in
/// cron's reading (numbers, names, ranges, steps, lists), or `None` if that
/// reading takes it (croner's extensions, `L`, `W`, `#` and `?`, are not
/// judged here).
pub(crate) fn field_mistake(index: usize, count: usize, text: &str) -> Option<String> {
    let extension = text.contains(['#', '?'])
        || (text.contains(['L', 'l', 'W', 'w']) && text.contains(|c: char| c.is_ascii_digit()))
        || text.eq_ignore_ascii_case("l");
    if extension {
        return None;
    }
    let spec = spec_of(index, count)?;
    spec.parse(text, 0).err().map(|(_, message)| message)
}
