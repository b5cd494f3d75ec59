//! The `pacer` command: parses the command line, sets up logging and calls the library.

use anyhow::Context;
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
    about = "Paces outbound events per route and admits inbound events per source, with shared state in Redis"
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
    /// Serve /metrics, /healthz and /readyz here instead of the config's metrics.listen (also
    /// PACER_METRICS_LISTEN; this flag wins).
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
    Report(ConfigArg),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (path, metrics_flag) = match &cli.command {
        Command::Run(r) | Command::CheckConfig(r) => (&r.config.config, r.metrics_listen.clone()),
        Command::Report(c) => (&c.config, None),
        Command::Produce { config, .. } => (&config.config, None),
    };
    let mut overrides = Overrides::from_env();
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
            "{}: ok ({} routes, {} inbound rules, {} input streams; redis: {} {})",
            path.display(),
            cfg.outbound.routes.len(),
            inbound.map_or(0, |i| i.rules.len()),
            cfg.outbound.streams.len() + inbound.map_or(0, |i| i.streams.len()),
            cfg.redis.mode,
            cfg.redis.url.redacted(),
        );
        return ExitCode::SUCCESS;
    }
    telemetry::init_tracing(cli.log_format);
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    match runtime.block_on(async_main(cli.command, cfg)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pacer: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn async_main(command: Command, cfg: Config) -> anyhow::Result<()> {
    match command {
        Command::Run(_) => run(cfg).await,
        Command::Produce {
            count,
            routes,
            bad_every,
            ..
        } => {
            let routes = if routes.is_empty() {
                cfg.outbound.routes.keys().cloned().collect()
            } else {
                routes
            };
            if cfg.outbound.streams.is_empty() {
                anyhow::bail!("the config has no outbound input stream to push demo events to");
            }
            let mut con = connect(&cfg).await?;
            pacer::produce::produce(
                &mut con,
                &cfg.outbound.streams[0],
                &routes,
                count,
                bad_every,
            )
            .await?;
            println!("pushed {count} events to {}", cfg.outbound.streams[0]);
            Ok(())
        }
        Command::Report(_) => {
            let mut con = connect(&cfg).await?;
            print!("{}", pacer::report::report(&mut con, &cfg).await?);
            Ok(())
        }
        Command::CheckConfig(_) => unreachable!("handled before the runtime starts"),
    }
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
    let listener = tokio::net::TcpListener::bind(cfg.metrics.listen)
        .await
        .with_context(|| format!("binding metrics.listen {}", cfg.metrics.listen))?;
    tracing::info!(listen = %listener.local_addr()?, "serving /metrics, /healthz and /readyz");
    let shutdown = CancellationToken::new();
    let server_stop = CancellationToken::new();
    let server = tokio::spawn(pacer::server::serve(
        listener,
        metrics,
        health.clone(),
        server_stop.clone(),
    ));
    tokio::spawn(wait_for_signal(shutdown.clone()));
    let worker = pacer::worker::Worker::new(cfg, health)?;
    let ran = worker.run(shutdown).await;
    server_stop.cancel();
    let _ = server.await;
    Ok(ran?)
}

/// Cancels `shutdown` on SIGTERM or SIGINT.
async fn wait_for_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: draining"),
        _ = int.recv() => tracing::info!("SIGINT: draining"),
    }
    shutdown.cancel();
}
