//! `tessera keys` (API keys in a keys file) and `tessera audit` (the audit log's chain).

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use serde_json::json;
use std::path::PathBuf;
use tessera_access::{AuditLog, KeyStore, Role};

#[derive(Subcommand)]
pub enum KeysCommand {
    /// Make a key for a tenant; its text is printed once (the file keeps only a salted
    /// hash). A running gateway picks it up within a second.
    Add(AddArgs),
    /// The keys of a keys file: id, tenant, role, name, made and revoked times.
    List(FileArgs),
    /// Revoke a key by its id; a running gateway refuses it within a second.
    Revoke(RevokeArgs),
    /// Make a host's identity for a secured cluster (`[security]`): DIR/NAME.key, readable
    /// by its owner only, and DIR/NAME.pub, to copy into every host's keys directory.
    GenHost(GenHostArgs),
    /// Make a key that seals the keys file and the audit log at rest: FILE, readable by
    /// its owner only (`[security] at_rest_key_file`, or `TESSERA_AT_REST_KEY_FILE`).
    GenAtRest(GenAtRestArgs),
}

#[derive(Args)]
pub struct GenAtRestArgs {
    /// The key file to write (never replaced).
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
}

#[derive(Args)]
pub struct GenHostArgs {
    /// The host's name in the topology (`[[hosts]] name`).
    #[arg(long)]
    name: String,
    /// The directory to write to (the topology's `security.keys_dir`); made if missing.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

#[derive(Args)]
pub struct FileArgs {
    /// The keys file (the topology's `gateway.keys_file`).
    #[arg(long, value_name = "PATH")]
    file: PathBuf,
    /// The audit log key changes are written to (default: `audit.log` beside the keys
    /// file, as the gateway's default).
    #[arg(long, value_name = "PATH")]
    audit: Option<PathBuf>,
}

impl FileArgs {
    fn audit(&self) -> AuditLog {
        AuditLog::new(self.audit.clone().unwrap_or_else(|| self.file.with_file_name("audit.log")))
    }
}

#[derive(Args)]
pub struct AddArgs {
    #[command(flatten)]
    file: FileArgs,
    /// The tenant the key serves (a `[[tenants]]` name; `default` in a cluster without
    /// tenants).
    #[arg(long)]
    tenant: String,
    /// user (the OpenAI API), operator (also /admin/*) or admin.
    #[arg(long, default_value = "user")]
    role: Role,
    /// A label for who holds the key.
    #[arg(long)]
    name: Option<String>,
}

#[derive(Args)]
pub struct RevokeArgs {
    #[command(flatten)]
    file: FileArgs,
    /// The key's id, as `tessera keys list` shows it.
    id: String,
}

#[derive(Subcommand)]
pub enum AuditCommand {
    /// Check an audit log's hash chain: any edited, removed or reordered entry fails,
    /// naming the first that does not hold. Give rotated files oldest first
    /// (`audit.log.2 audit.log.1 audit.log`).
    Verify {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
}

/// Who is changing keys, for the audit log: the local user.
fn local_user() -> String {
    std::env::var("USER").map(|u| format!("cli:{u}")).unwrap_or_else(|_| "cli".to_owned())
}

fn audit_key_change(file: &FileArgs, event: &str, details: serde_json::Value) -> Result<()> {
    let log = file.audit();
    log.append(event, &local_user(), details)
        .with_context(|| format!("the key was changed, but writing the audit log {} failed", log.path().display()))?;
    Ok(())
}

pub fn keys(command: KeysCommand) -> Result<()> {
    match command {
        KeysCommand::GenAtRest(args) => {
            if args.out.exists() {
                bail!(
                    "{} already exists; remove it first to replace the at-rest key (what it sealed then no longer opens)",
                    args.out.display()
                );
            }
            let hex = tessera_access::at_rest::AtRestKey::generate_hex()?;
            tessera_access::files::write_private(&args.out, format!("{hex}\n").as_bytes())
                .with_context(|| format!("writing {}", args.out.display()))?;
            eprintln!(
                "at-rest key written to {} (owner-only); point [security] at_rest_key_file or TESSERA_AT_REST_KEY_FILE at it",
                args.out.display()
            );
            Ok(())
        }
        KeysCommand::GenHost(args) => {
            tessera_topology::check_name(&args.name).map_err(|e| anyhow::anyhow!("--name: {e}"))?;
            let pair = tessera_runtime::security::HostKeypair::generate()?;
            let (key, public) = pair.write(&args.out, &args.name)?;
            eprintln!(
                "host key for `{}`: {} (keep it on that host only) and {} (copy it into every host's keys directory); its public key, for hosts.public_key:",
                args.name,
                key.display(),
                public.display()
            );
            println!("{}", tessera_access::hex(pair.public()));
            Ok(())
        }
        KeysCommand::Add(args) => {
            let (record, key) = tessera_access::keys::add(&args.file.file, &args.tenant, args.role, args.name.clone())?;
            let details = json!({ "key": record.id, "tenant": record.tenant, "role": record.role.as_str(),
                "name": record.name, "file": args.file.file.display().to_string() });
            audit_key_change(&args.file, "key_created", details)?;
            eprintln!(
                "key {} for tenant `{}` ({}) added to {}; it is shown only now:",
                record.id,
                record.tenant,
                record.role,
                args.file.file.display()
            );
            println!("{key}");
            Ok(())
        }
        KeysCommand::List(args) => {
            let store = KeyStore::load(&args.file)?;
            println!("{:<14} {:<20} {:<9} {:<12} {:<12} name", "id", "tenant", "role", "created", "revoked");
            for r in store.records() {
                println!(
                    "{:<14} {:<20} {:<9} {:<12} {:<12} {}",
                    r.id,
                    r.tenant,
                    r.role,
                    r.created_unix,
                    r.revoked_unix.map_or_else(|| "-".to_owned(), |t| t.to_string()),
                    r.name.as_deref().unwrap_or("-")
                );
            }
            Ok(())
        }
        KeysCommand::Revoke(args) => {
            let record = tessera_access::keys::revoke(&args.file.file, &args.id)?;
            let details = json!({ "key": record.id, "tenant": record.tenant, "role": record.role.as_str(),
                "file": args.file.file.display().to_string() });
            audit_key_change(&args.file, "key_revoked", details)?;
            println!("key {} (tenant `{}`) revoked", record.id, record.tenant);
            Ok(())
        }
    }
}

pub fn audit(command: AuditCommand) -> Result<()> {
    match command {
        AuditCommand::Verify { files } => verify(&files),
    }
}

fn verify(files: &[PathBuf]) -> Result<()> {
    match tessera_access::verify(files) {
        Ok(report) => {
            let start = if report.from_genesis {
                "from the log's first entry".to_owned()
            } else {
                format!(
                    "from a rotation at seq {} (give the older files, oldest first, to check before it)",
                    report.first_seq
                )
            };
            println!("intact: {} entries, seq {}..={}, {start}", report.entries, report.first_seq, report.last_seq);
            Ok(())
        }
        Err(e) => bail!("the audit log does not hold: {e}"),
    }
}
