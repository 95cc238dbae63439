//! `try_spend` calls per second on one book: with one thread, then with
//! each thread count of `--threads` spending on the same book (each thread
//! on its own slice of the ads, as a bidder's request threads would).
//!
//! Besides calls per wall-clock second, each thread counts its calls per
//! second of its own CPU time (from `/proc/thread-self/schedstat`): the
//! rate of one core, whatever else the machine runs, and the figure that
//! shows whether threads slow each other down on the book's locks.
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
        let cpu_ns = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (book, ads, calls, stop) =
                    (book.clone(), ads.clone(), calls.clone(), stop.clone());
                let cpu_ns = cpu_ns.clone();
                std::thread::spawn(move || {
                    let cpu_start = thread_cpu_ns();
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
                    cpu_ns.fetch_add(thread_cpu_ns() - cpu_start, Relaxed);
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
        let per_cpu_sec = calls.load(Relaxed) as f64 / (cpu_ns.load(Relaxed) as f64 / 1e9);
        println!(
            "threads {threads}: {:.2} M calls/s ({:.2} M per thread), {speedup:.2}x the first; {:.2} M calls per CPU-second of a thread",
            rate / 1e6,
            rate / 1e6 / threads as f64,
            per_cpu_sec / 1e6
        );
    }
}

/// Nanoseconds this thread has run on a CPU.
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
