//! `try_spend` calls per second on one book: with one thread, then with
//! each thread count of `--threads` spending on the same book (each thread
//! on its own slice of the ads, as a bidder's request threads would).
//!
//! `cargo bench -p adspend-client --bench try_spend -- --threads 1,2,4 --ads 10000 --secs 3`

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use adspend_client::{Grant, LeaseBook, LeasePolicy};

struct Args {
    threads: Vec<usize>,
    ads: usize,
    secs: f64,
}

fn args() -> Args {
    let mut out = Args {
        threads: vec![1, 2],
        ads: 10_000,
        secs: 3.0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--threads" => {
                out.threads = value()
                    .split(',')
                    .map(|t| t.parse().expect("--threads: comma-separated counts"))
                    .collect()
            }
            "--ads" => out.ads = value().parse().expect("--ads: a count"),
            "--secs" => out.secs = value().parse().expect("--secs: seconds"),
            "--bench" => {}
            other => panic!("unknown flag {other} (--threads, --ads, --secs)"),
        }
    }
    out
}

fn main() {
    let args = args();
    let book = LeaseBook::new(LeasePolicy::default()).expect("policy");
    let ads: Arc<Vec<String>> = Arc::new((0..args.ads).map(|i| format!("ad-{i}")).collect());
    let far = i64::MAX / 2;
    for (i, ad) in ads.iter().enumerate() {
        book.install(
            &Grant {
                ad_id: ad.clone(),
                lease_id: Some(format!("lease.{i}.0")),
                granted_micros: u64::MAX / 4,
                expires_at_ms: far,
            },
            0,
        );
    }
    println!(
        "try_spend on one book of {} ads, {:.0} s per run, {} cores here",
        args.ads,
        args.secs,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let mut base = None;
    for &threads in &args.threads {
        let calls = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (book, ads, calls, stop) =
                    (book.clone(), ads.clone(), calls.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mine: Vec<&String> = ads.iter().skip(t).step_by(threads).collect();
                    let mut n = 0u64;
                    let mut i = 0usize;
                    while !stop.load(Relaxed) {
                        for _ in 0..1024 {
                            let ad = mine[i % mine.len()];
                            i = i.wrapping_add(7);
                            let id = book.try_spend(ad, 1_000).expect("a lease with room");
                            std::hint::black_box(id);
                        }
                        n += 1024;
                    }
                    calls.fetch_add(n, Relaxed);
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs_f64(args.secs));
        stop.store(true, Relaxed);
        for h in handles {
            h.join().expect("bench thread");
        }
        let rate = calls.load(Relaxed) as f64 / started.elapsed().as_secs_f64();
        let speedup = base.map_or(1.0, |b: f64| rate / b);
        base.get_or_insert(rate);
        println!(
            "threads {threads}: {:.2} M calls/s ({:.2} M per thread), {speedup:.2}x the first",
            rate / 1e6,
            rate / 1e6 / threads as f64
        );
    }
}
