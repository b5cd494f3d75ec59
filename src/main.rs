//! The `pacer` command: parses the command line, sets up logging and calls the library.

use clap::{Args, Parser, Subcommand};
use pacer::config::{Config, Overrides, Sourced};
use pacer::connection::RedisConn;
use pacer::telemetry::{self, LogFormat};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "pacer",
    version,
    about = "Paces outbound events per route and admits inbound events per source, with shared state in Redis",
    after_help = "Environment:
  PACER_CONFIG                   the config file (instead of --config)
  PACER_REDIS_URL                redis.url (several comma-separated URLs for cluster seeds or sentinels)
  PACER_REDIS_MODE               redis.mode: standalone, cluster or sentinel
  PACER_REDIS_PASSWORD           the Redis password (instead of the URL or redis.password_file)
  PACER_REDIS_SENTINEL_PASSWORD  the sentinels' own password (instead of redis.sentinel.password_file)
  PACER_METRICS_LISTEN           metrics.listen (for `run`; --metrics-listen wins)
  PACER_LOG_FORMAT               text or json (instead of --log-format)
  RUST_LOG                       the log filter (default info,redis=error)"
)]
struct Cli {
    /// Log format (filter with RUST_LOG).
    #[arg(
        long,
        env = "PACER_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct ConfigArg {
    /// The config file.
    #[arg(long, env = "PACER_CONFIG", default_value = "config.yaml")]
    config: PathBuf,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// Where `run` serves /metrics, /healthz and /readyz, instead of the config's
    /// metrics.listen (also PACER_METRICS_LISTEN; this flag wins); check-config checks it.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon until SIGTERM or SIGINT.
    Run(RunArgs),
    /// Check the config: print every problem with its path, exit non-zero if there is any.
    CheckConfig(RunArgs),
    /// Push demo events onto the first input stream.
    Produce {
        #[command(flatten)]
        config: ConfigArg,
        /// How many events to push.
        #[arg(long, default_value_t = 300)]
        count: usize,
        /// Routes to spread events over (default: every configured route).
        #[arg(long, value_delimiter = ',')]
        routes: Vec<String>,
        /// Make every Nth event name an unknown route.
        #[arg(long)]
        bad_every: Option<usize>,
    },
    /// Show what pacer wrote: per route dispatched, rerouted, rejected, spacing and lateness.
    /// Exits 3 when it could not read some of it (named on `cannot read:` lines).
    Report {
        #[command(flatten)]
        config: ConfigArg,
        /// Only entries written within this long before now, by Redis's clock (like 10m, 1h).
        /// Without it: everything the output streams still hold.
        #[arg(long, value_parser = humantime::parse_duration)]
        since: Option<std::time::Duration>,
    },
    /// Show what pacer is doing now: per route the slots planned ahead and the wait a new event
    /// would get; per input stream its length, lag, pending entries and the consumers; output
    /// streams held past max_len by a consumer group, with the groups. Exits 3 when it could
    /// not read some of it (named on `cannot read:` lines).
    Inspect {
        #[command(flatten)]
        config: ConfigArg,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// The runtime: `threads` worker threads, or by default one per core this process may use (as
/// tokio counts them: `TOKIO_WORKER_THREADS`, else the cores, which honours a container's CPU
/// quota).
///
/// One thread is tokio's current-thread runtime, not a multi-thread one with one worker, also
/// when the default comes to one (a pod with one CPU). The latter runs a task just woken before
/// those already queued (its LIFO slot), so an HTTP/2 connection task woken by each answered
/// stream wrote each answer in a syscall of its own (one `writev` per gRPC decision, by `perf
/// stat`); the former queues it behind the other streams, and one `writev` carries the answers
/// of several (one per five decisions). On the sync benchmark that took gRPC's leased
/// closed-loop p99 from 4.7 to 0.7 ms (README).
fn runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let threads = match threads {
        0 => std::env::var("TOKIO_WORKER_THREADS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .filter(|&n: &usize| n > 0)
            .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
            .unwrap_or(1),
        n => n,
    };
    if threads == 1 {
        return tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (path, metrics_flag) = match &cli.command {
        Command::Run(r) | Command::CheckConfig(r) => (&r.config.config, r.metrics_listen.clone()),
        Command::Report { config, .. }
        | Command::Inspect { config, .. }
        | Command::Produce { config, .. } => (&config.config, None),
    };
    let mut overrides = Overrides::from_env();
    if !matches!(cli.command, Command::Run(_) | Command::CheckConfig(_)) {
        // PACER_METRICS_LISTEN is `run`'s (its --help says so): a bad one must not stop
        // `inspect`, `report` or `produce`, which serve no metrics.
        overrides.metrics_listen = None;
    }
    if let Some(value) = metrics_flag {
        // The flag wins over the environment.
        overrides.metrics_listen = Some(Sourced {
            value,
            source: "--metrics-listen",
        });
    }
    let cfg = match Config::load(path, &overrides) {
        Ok(cfg) => cfg,
        Err(e) => {
            eprint!("{}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    if let Command::CheckConfig(_) = cli.command {
        let inbound = cfg.inbound.as_ref();
        println!(
            "{}: ok ({}, {}, {}; redis: {} {})",
            path.display(),
            count(cfg.outbound.routes.len(), "route"),
            count(inbound.map_or(0, |i| i.rules.len()), "inbound rule"),
            count(cfg.input_streams().count(), "input stream"),
            cfg.redis.mode,
            cfg.redis.url.redacted(),
        );
        for caution in cfg.cautions() {
            println!("caution: {caution}");
        }
        return ExitCode::SUCCESS;
    }
    telemetry::init_tracing(cli.log_format);
    let runtime = runtime(cfg.worker.threads).expect("a tokio runtime");
    match runtime.block_on(async_main(cli.command, cfg)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pacer: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// What `inspect` and `report` exit with when they showed what they could read but not all of
/// it (as `ls` exits 1 for "minor problems"; 1 and 2 are pacer's failure and bad config).
const SHOWN_IN_PART: u8 = 3;

async fn async_main(command: Command, cfg: Config) -> anyhow::Result<ExitCode> {
    let in_part = |problems: &[String]| {
        if problems.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(SHOWN_IN_PART)
        }
    };
    match command {
        Command::Run(_) => run(cfg).await.map(|()| ExitCode::SUCCESS),
        Command::Produce {
            count,
            routes,
            bad_every,
            ..
        } => {
            // `--routes 'a, b'` names a and b: the spaces are the shell's, not the route's.
            let routes: Vec<String> = routes
                .iter()
                .map(|r| r.trim().to_string())
                .filter(|r| !r.is_empty())
                .collect();
            let routes = if routes.is_empty() {
                cfg.outbound.routes.keys().cloned().collect()
            } else {
                let unknown: Vec<&str> = routes
                    .iter()
                    .filter(|r| !cfg.outbound.routes.contains_key(*r))
                    .map(String::as_str)
                    .collect();
                if !unknown.is_empty() {
                    anyhow::bail!(
                        "no such route in the config: {} (routes: {})",
                        unknown.join(", "),
                        cfg.outbound.order.join(", ")
                    );
                }
                routes
            };
            if cfg.outbound.flow.streams.is_empty() {
                anyhow::bail!("the config has no outbound input stream to push demo events to");
            }
            let mut con = connect(&cfg).await?;
            pacer::produce::produce(
                &mut con,
                &cfg.outbound.flow.streams[0],
                &routes,
                count,
                bad_every,
            )
            .await?;
            println!("pushed {count} events to {}", cfg.outbound.flow.streams[0]);
            Ok(ExitCode::SUCCESS)
        }
        Command::Report { since, .. } => {
            let mut con = connect(&cfg).await?;
            let report = pacer::report::report(&mut con, &cfg, since).await?;
            print!("{report}");
            Ok(in_part(&report.problems))
        }
        Command::Inspect { json, .. } => {
            let mut con = connect(&cfg).await?;
            let state = pacer::inspect::inspect(&mut con, &cfg).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&state)?);
            } else {
                print!("{state}");
            }
            Ok(in_part(&state.problems))
        }
        Command::CheckConfig(_) => unreachable!("handled before the runtime starts"),
    }
}

/// "1 route", "2 routes".
fn count(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

/// A connection for the one-shot commands, checked now: they should fail at once with a clear
/// message (a refused password, a certificate that does not verify, nothing listening), where
/// the daemon waits. Every message names the Redis redacted.
async fn connect(cfg: &Config) -> anyhow::Result<RedisConn> {
    let mut con = RedisConn::new(&cfg.redis, cfg.redis.timeout)?;
    con.check().await?;
    Ok(con)
}

async fn run(cfg: Config) -> anyhow::Result<()> {
    let metrics = telemetry::install_metrics().map_err(anyhow::Error::msg)?;
    telemetry::register(&cfg);
    let health = Arc::new(pacer::health::Health::default());
    let shutdown = CancellationToken::new();
    let server_stop = CancellationToken::new();
    let servers = pacer::server::start(&cfg, metrics, health.clone(), server_stop.clone())
        .await
        .map_err(anyhow::Error::msg)?;
    tokio::spawn(wait_for_signal(shutdown.clone()));
    let worker = pacer::worker::Worker::new(cfg, health)?;
    let ran = worker.run(shutdown).await;
    server_stop.cancel();
    for server in servers {
        let _ = server.await;
    }
    Ok(ran?)
}

/// Cancels `shutdown` on SIGTERM or SIGINT.
async fn wait_for_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    // Acted on before it is said: a log line that cannot be written must not cost the signal.
    shutdown.cancel();
    tracing::info!("{name}: draining");
}
