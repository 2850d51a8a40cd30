//! What handing webhook deliveries over costs (docs/protocol.md, "Webhook
//! deliveries handed over"): a stopping node hands over N deliveries of
//! 2 KiB in calls of 100, then three takers take them at once, 100 a call,
//! until none is left. Printed per store: the hand-over's time, the take's
//! time and calls, and how many each taker got (every delivery once: a
//! double or a loss fails the run); the floor is N store round trips
//! (`ping`, one after another), what taking one delivery per round trip
//! would cost, and the ratio is take / floor.
//!
//! cargo bench --all-features --bench outbox -- [--stores sqlite,redis,...]
//! [--deliveries 1000]

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
mod common;
#[allow(dead_code)]
#[path = "../tests/it/support.rs"]
mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use cronlease::store::outbox::TAKE_AT_MOST;
use cronlease::store::{Owner, Parcel};

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1e3)
}

#[tokio::main]
async fn main() {
    let n: usize = common::arg("--deliveries", "1000")
        .parse()
        .expect("--deliveries N");
    let stores = if std::env::args().any(|a| a == "--stores") {
        common::stores()
    } else {
        vec![support::Backend::Sqlite, support::Backend::Redis]
    };
    println!(
        "| store | deliveries | hand over ms | take ms (3 takers) | take calls (3 empty each at the end) | per taker | floor: {n} round trips ms | take / floor |"
    );
    println!("|---|---:|---:|---:|---:|---|---:|---:|");
    for backend in stores {
        let h = support::Harness::new(backend).await;
        let store = h.store().await;
        let body = format!("{{\"output_tail\":\"{}\"}}", "x".repeat(2048));
        let parcels: Vec<Parcel> = (0..n)
            .map(|i| Parcel {
                id: format!(
                    "ops~{:013}-job-{i}-failed",
                    1_764_000_000_000_u64 + i as u64
                ),
                body: body.clone(),
            })
            .collect();
        let started = Instant::now();
        for chunk in parcels.chunks(TAKE_AT_MOST) {
            store.hand_over(chunk).await.unwrap();
        }
        let handed = started.elapsed();
        let started = Instant::now();
        let mut takers = Vec::new();
        for t in 0..3 {
            let store = h.store().await;
            takers.push(tokio::spawn(async move {
                let me = Owner::from_raw(format!("bench{t}#{t}"));
                let (mut got, mut calls, mut empty) = (Vec::new(), 0, 0);
                let mut last = Instant::now();
                while empty < 3 {
                    let took = store
                        .take_handed_over(&me, "ops~", TAKE_AT_MOST)
                        .await
                        .unwrap();
                    calls += 1;
                    if took.is_empty() {
                        empty += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    } else {
                        empty = 0;
                        last = Instant::now();
                    }
                    got.extend(took.into_iter().map(|p| p.id));
                }
                (got, calls, last)
            }));
        }
        let mut all = Vec::new();
        let (mut calls, mut per, mut done) = (0, Vec::new(), started);
        for t in takers {
            let (got, c, last) = t.await.unwrap();
            per.push(got.len().to_string());
            calls += c;
            done = done.max(last);
            all.extend(got);
        }
        // Until the last delivery was taken (the empty rounds after are
        // how a taker sees it is done, not part of the take).
        let took = done - started;
        let unique: BTreeSet<&String> = all.iter().collect();
        assert_eq!(all.len(), n, "{backend:?}: taken {} of {n}", all.len());
        assert_eq!(unique.len(), n, "{backend:?}: a delivery taken twice");
        let started = Instant::now();
        for _ in 0..n {
            store.ping().await.unwrap();
        }
        let floor = started.elapsed();
        println!(
            "| {backend:?} | {n} | {} | {} | {calls} | {} | {} | {:.2} |",
            ms(handed),
            ms(took),
            per.join(" / "),
            ms(floor),
            took.as_secs_f64() / floor.as_secs_f64()
        );
    }
}
