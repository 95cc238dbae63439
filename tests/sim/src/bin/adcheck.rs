//! Compare the pacer's per-limit spend with the simulator's ground truth.
//! Exits 0 when every limit matches exactly, 1 otherwise.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use adspend_sim::check::wait_for_match_with;
use adspend_sim::check::PacerAccess;
use adspend_sim::Truth;
use clap::Parser;

#[derive(Parser)]
#[command(name = "adcheck", version)]
struct Args {
    /// Pacer base URL.
    #[arg(long, env = "ADCHECK_PACER", default_value = "http://127.0.0.1:8080")]
    pacer: String,
    /// Ground truth written by `adsim run`.
    #[arg(long, env = "ADCHECK_TRUTH", default_value = "truth.json")]
    truth: PathBuf,
    /// PEM file of the CA that signed the pacer's certificate (an https:// pacer).
    #[arg(long, env = "ADSPEND_PACER_TLS_CA")]
    pacer_ca: Option<PathBuf>,
    /// Bearer token of the pacer's read scope, when it asks for one.
    #[arg(long, env = "ADSPEND_PACER_READ_TOKEN", hide_env_values = true)]
    pacer_token: Option<String>,
    /// Seconds to wait for the pipeline to catch up.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Rows to print (limits with the most spend first).
    #[arg(long, default_value_t = 15)]
    show: usize,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let truth = match Truth::load(&args.truth) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("adcheck: error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let access = PacerAccess {
        url: args.pacer.clone(),
        ca: args.pacer_ca.clone(),
        read_token: args.pacer_token.clone(),
    };
    let http = match access.client(Duration::from_secs(10)) {
        Ok(http) => http,
        Err(e) => {
            eprintln!("adcheck: error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let timeout = Duration::from_secs(args.timeout);
    match wait_for_match_with(&http, &args.pacer, &truth, timeout).await {
        Ok((comparison, waited)) => {
            print!("{}", comparison.render(args.show));
            let bad = comparison.mismatches().len();
            if bad == 0 {
                println!(
                    "pacer equals ground truth for every limit (caught up after {:.1}s)",
                    waited.as_secs_f64()
                );
                ExitCode::SUCCESS
            } else {
                println!(
                    "{bad} limits differ after {}s; largest difference {} micros",
                    args.timeout,
                    comparison.max_abs_diff()
                );
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("adcheck: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
