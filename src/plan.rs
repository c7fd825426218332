//! `tessera plan`: the live solver of a running cluster, through its gateway's admin
//! routes (which put each question on the bus to the solver actor).

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use std::time::Duration;
use tessera_actors::msg::{PlanView, StrategyView};

#[derive(Subcommand)]
pub enum PlanCommand {
    /// What each chip does, the strategy in force and the solver's latest Pareto set.
    Show(ShowArgs),
    /// Apply a strategy of the latest set by its id (`s3-2`), or your own assignment
    /// (`--role h1-metax0=prefill`): chips that change duty drain first, so no request
    /// is lost.
    Apply(ApplyArgs),
    /// Ask the solver to solve again now.
    Solve(GatewayArg),
}

#[derive(Args)]
pub struct GatewayArg {
    /// The cluster's gateway.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    gateway: String,
    /// An operator's or admin's key (default: `$TESSERA_API_KEY`, else the admin token
    /// `tessera up` wrote on this machine for that gateway).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
}

impl GatewayArg {
    /// The key admin calls carry: the one given, the environment's, or the gateway's
    /// generated admin token if it runs on this machine.
    fn key(&self) -> Option<String> {
        if let Some(key) = self.api_key.clone().or_else(|| std::env::var("TESSERA_API_KEY").ok()) {
            return Some(key);
        }
        let url = reqwest::Url::parse(&self.gateway).ok()?;
        let host = match url.host_str()? {
            "localhost" => std::net::IpAddr::from([127, 0, 0, 1]),
            other => other.trim_start_matches('[').trim_end_matches(']').parse().ok()?,
        };
        let addr = std::net::SocketAddr::new(host, url.port_or_known_default()?);
        tessera_access::token::read(&tessera_backends::builtin::cache_dir(), addr)
    }
}

#[derive(Args)]
pub struct ShowArgs {
    #[command(flatten)]
    gateway: GatewayArg,
    /// Print the solver's state as JSON.
    #[arg(long)]
    json: bool,
    /// Strategies of the set to print (every one with --json).
    #[arg(long, default_value_t = 12)]
    rows: usize,
}

#[derive(Args)]
pub struct ApplyArgs {
    /// The strategy's id, as `plan show` lists it.
    #[arg(required_unless_present = "roles", conflicts_with = "roles")]
    id: Option<String>,
    /// CHIP=DUTY (prefill, decode, both or idle), repeated: the other chips keep theirs.
    #[arg(long = "role", value_name = "CHIP=DUTY")]
    roles: Vec<String>,
    #[command(flatten)]
    gateway: GatewayArg,
}

pub fn plan(command: PlanCommand) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        match command {
            PlanCommand::Show(args) => {
                let body = call(&args.gateway, "GET", "/admin/plan", None).await?;
                if args.json {
                    println!("{}", serde_json::to_string_pretty(&body)?);
                    return Ok(());
                }
                let view: PlanView = serde_json::from_value(body).context("the gateway's plan is not a plan")?;
                print!("{}", render(&view, args.rows));
                Ok(())
            }
            PlanCommand::Apply(args) => {
                let body = match args.id {
                    Some(id) => json!({ "id": id }),
                    None => {
                        let mut roles = serde_json::Map::new();
                        for pair in &args.roles {
                            let Some((chip, duty)) = pair.split_once('=') else {
                                bail!("--role {pair:?}: expected CHIP=DUTY, e.g. h1-metax0=prefill");
                            };
                            roles.insert(chip.trim().to_string(), Value::String(duty.trim().to_string()));
                        }
                        json!({ "roles": roles })
                    }
                };
                let plan = call(&args.gateway, "POST", "/admin/plan/apply", Some(body)).await?;
                let moves = plan["moves"].as_array().map_or(0, Vec::len);
                println!("applied {}: {}", plan["id"].as_str().unwrap_or("?"), plan["summary"].as_str().unwrap_or("?"));
                for m in plan["moves"].as_array().into_iter().flatten() {
                    let field = |i: usize| m[i].as_str().unwrap_or("?");
                    println!("  {} drains, then {} -> {}", field(0), field(1), field(2));
                }
                if moves == 0 {
                    println!("  no chip changes duty (step limits only)");
                }
                Ok(())
            }
            PlanCommand::Solve(args) => {
                call(&args, "POST", "/admin/plan/solve", None).await?;
                println!("solving; `tessera plan show` lists the new set when it is done");
                Ok(())
            }
        }
    })
}

/// One admin call; an error reply becomes an error carrying the gateway's message.
async fn call(gateway: &GatewayArg, method: &str, path: &str, body: Option<Value>) -> Result<Value> {
    let key = gateway.key();
    let gateway = &gateway.gateway;
    let url = format!("{}{path}", gateway.trim_end_matches('/'));
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
    let mut request = match method {
        "POST" => client.post(&url).json(&body.unwrap_or(Value::Null)),
        _ => client.get(&url),
    };
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.with_context(|| format!("cannot reach the gateway at {gateway}"))?;
    let status = response.status();
    let value: Value = response.json().await.with_context(|| format!("{url}: the reply is not JSON"))?;
    if !status.is_success() {
        let message = value["error"]["message"].as_str().unwrap_or("(no message)");
        if status == reqwest::StatusCode::UNAUTHORIZED {
            bail!(
                "{url}: {status}: {message} (pass an operator's key with --api-key or TESSERA_API_KEY; a gateway without a keys file takes the admin token in $TESSERA_HOME/admin/, which this machine's CLI reads by itself)"
            );
        }
        bail!("{url}: {status}: {message}");
    }
    Ok(value)
}

fn row(s: &StrategyView) -> String {
    let f = &s.figures;
    format!(
        "  {:<8} {:>9.2} {:>9.0} {:>9.1} {:>9.2} {:>9.0} {:>5} {:>7.1}  {}\n",
        s.id,
        f.goodput_rps,
        f.ttft_p90_s * 1e3,
        f.tpot_p90_s * 1e3,
        f.usd_per_million_tokens,
        f.goodput_per_usd(),
        s.moves.len(),
        s.drain_s,
        s.summary
    )
}

/// `plan show`'s text.
pub fn render(view: &PlanView, rows: usize) -> String {
    let mut out = format!(
        "solver: {} for {}\n",
        if view.auto { "applies the best strategy itself (auto)" } else { "publishes strategies" },
        view.objective
    );
    let chips: Vec<String> = view.chips.iter().map(|(id, duty)| format!("{id} {duty}")).collect();
    out += &format!("chips now: {}\n", chips.join(", "));
    match &view.applied {
        Some(p) => {
            out += &format!("in force: {} ({}), applied by {} at {:.1} s\n", p.id, p.summary, p.by, p.at_s);
        }
        None => out += "in force: the topology as written\n",
    }
    let Some(set) = &view.latest else {
        out += if view.solving {
            "solving: the first set comes when this solve is done\n"
        } else {
            "no strategy set yet: the solver solves once requests have arrived and one has ended\n"
        };
        return out;
    };
    let w = &set.workload;
    out += &format!(
        "latest set {} ({}) at {:.1} s: {:.2} req/s measured, planned for {:.2}; prompts {:.0} tokens, \
         outputs {:.0} tokens{}; SLOs TTFT {:.0} ms, TPOT {:.0} ms (p90); {} of {} chips up; figures {}\n",
        set.seq,
        set.reason,
        set.at_s,
        set.observed_rate_rps,
        w.rate_rps,
        w.isl,
        w.osl,
        set.prefix_hit_rate.map_or(String::new(), |h| format!(", prefix hit rate {h:.3}")),
        set.slo.ttft_s * 1e3,
        set.slo.tpot_s * 1e3,
        set.chips_up,
        set.chips_total,
        set.figures_from
    );
    out += "  id        goodput  TTFT p90  TPOT p90    $/Mtok     req/$ moves drain s  strategy\n";
    out += "              req/s        ms        ms\n";
    for s in set.strategies.iter().take(rows) {
        out += &row(s);
    }
    if set.strategies.len() > rows {
        out += &format!("  ... {} more (--rows N, or --json)\n", set.strategies.len() - rows);
    }
    if set.strategies.is_empty() {
        out += "  no strategy serves a request within the SLOs at this traffic\n";
    }
    match &set.current {
        Some(now) => {
            out += "in force, for the same traffic:\n";
            out += &row(now);
        }
        None => out += "in force, for the same traffic: serves nothing within the SLOs (the analytic model's view)\n",
    }
    out
}
