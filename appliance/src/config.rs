//! The daemons' configuration files: TOML whose keys are the daemon's long
//! flags without the leading `--`, spelled as on the command line (dashes:
//! `memory-budget`, `reconcile-ms`). Each key becomes the words the command
//! line would carry (`--memory-budget=4GiB`), put before the real command
//! line's for every flag the command line does not give: clap stays the one
//! parser, and the command line overrides the file.
//!
//! Values by kind of flag:
//! - a flag that takes a value: a string, integer or float
//!   (`listen = "0.0.0.0:7700"`, `reconcile-ms = 2000`, `memory-budget = "4GiB"`);
//! - a switch (`--busy-poll`): `true` or `false`;
//! - a repeatable flag (`--appliance`, `--eal-arg`): an array of strings (a
//!   single string is one element). The command line replaces the file's
//!   list, it does not add to it.
//!
//! `--config FILE` chooses the file; without it the daemon's default path
//! (`/etc/phub/<daemon>.toml`) is read if it exists, unless
//! `PHUB_NO_SYSTEM_CONFIG` is set. An unknown key, a key
//! spelled with underscores, a value of the wrong type or one the flag
//! refuses is an error naming the file, the key and what is accepted.
//!
//! Known limit: a switch set `true` in the file cannot be turned off on the
//! command line (clap switches have no `--no-` form); point `--config` at
//! another file (`--config /dev/null` reads none).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::{Arg, ArgAction, Command};

/// The id and long name of the flag every daemon gets for its file.
pub const CONFIG_FLAG: &str = "config";

/// Why a configuration file could not be used; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("configuration file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("configuration file {}: not valid TOML: {message}", path.display())]
    Syntax {
        /// The file.
        path: PathBuf,
        /// The TOML parser's message (with line and column).
        message: String,
    },
    /// A key names no flag of the daemon.
    #[error("configuration file {}: unknown key `{key}`{hint}; accepted keys: {accepted}", path.display())]
    UnknownKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// A suggestion (the dashed spelling), or empty.
        hint: String,
        /// Every key the daemon accepts.
        accepted: String,
    },
    /// A value of the wrong TOML type, or one the flag refuses.
    #[error("configuration file {}: `{key}` = {value}: {message}", path.display())]
    BadValue {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// The value as written in TOML.
        value: String,
        /// What is wrong and what is accepted.
        message: String,
    },
    /// `--config` without a file name.
    #[error("--config needs a file name (e.g. --config /etc/phub/control.toml)")]
    MissingPath,
}

/// Where `--config` points in `args` (the program name first), if given:
/// `--config FILE` or `--config=FILE`, before any `--`.
pub fn config_arg(args: &[OsString]) -> Result<Option<PathBuf>, ConfigError> {
    let mut found = None;
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        let Some(s) = a.to_str() else { continue };
        if s == "--" {
            break;
        }
        if s == "--config" {
            found = Some(PathBuf::from(it.next().ok_or(ConfigError::MissingPath)?));
        } else if let Some(p) = s.strip_prefix("--config=") {
            if p.is_empty() {
                return Err(ConfigError::MissingPath);
            }
            found = Some(PathBuf::from(p));
        }
    }
    Ok(found)
}

/// Set (to anything but empty) in the environment, the daemons do not read
/// their default file: tests run from a checkout on a machine where the
/// package is installed must not pick up its `/etc/phub` (`make test` sets
/// it). `--config` still works.
pub const NO_SYSTEM_CONFIG_ENV: &str = "PHUB_NO_SYSTEM_CONFIG";

/// The file to read: `--config`'s, else `default` when it exists (and
/// [`NO_SYSTEM_CONFIG_ENV`] is not set), else none.
pub fn chosen_file(args: &[OsString], default: &Path) -> Result<Option<PathBuf>, ConfigError> {
    let skip_default = std::env::var_os(NO_SYSTEM_CONFIG_ENV).is_some_and(|v| !v.is_empty());
    Ok(match config_arg(args)? {
        Some(p) => Some(p),
        None if !skip_default && default.exists() => Some(default.to_path_buf()),
        None => None,
    })
}

/// `cmd` with the `--config` flag added (its help names `default`).
pub fn with_config_flag(cmd: Command, default: &Path) -> Command {
    cmd.arg(
        Arg::new(CONFIG_FLAG)
            .long(CONFIG_FLAG)
            .value_name("FILE")
            .value_parser(clap::value_parser!(PathBuf))
            .help(leak(format!(
                "Configuration file: TOML, one key per long flag without `--` (dashed, e.g. \
                 `memory-budget = \"4GiB\"`); the command line overrides it [default: {} if it exists]",
                default.display()
            ))),
    )
}

/// The keys a file for `cmd` may hold: every long flag but help, version
/// and config itself.
pub fn keys(cmd: &Command) -> Vec<String> {
    cmd.get_arguments()
        .filter_map(|a| a.get_long())
        .filter(|l| !matches!(*l, "help" | "version" | CONFIG_FLAG))
        .map(str::to_string)
        .collect()
}

/// One key of a configuration file, as command-line words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileValue {
    /// The clap id of the flag the key names.
    pub id: clap::Id,
    /// The words the command line would carry (`--key=value`, once per
    /// value; none for a switch set false).
    pub words: Vec<String>,
}

/// Reads `path` and turns each of its keys into the command-line words of
/// the flag it names in `cmd`, after checking the value with the flag's own
/// parser.
pub fn read_file(cmd: &Command, path: &Path) -> Result<Vec<FileValue>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| ConfigError::Syntax {
        path: path.to_path_buf(),
        message: e.to_string().trim_end().to_string(),
    })?;
    let accepted = keys(cmd);
    let mut out = Vec::new();
    for (key, value) in table {
        let bad = |message: String| ConfigError::BadValue {
            path: path.to_path_buf(),
            key: key.clone(),
            value: value.to_string(),
            message,
        };
        let Some(arg) = (if accepted.contains(&key) {
            cmd.get_arguments()
                .find(|a| a.get_long() == Some(key.as_str()))
                .cloned()
        } else {
            None
        }) else {
            let dashed = key.replace('_', "-");
            let hint = if dashed != key && accepted.contains(&dashed) {
                format!(" (keys are spelled as the flags, with dashes: `{dashed}`)")
            } else {
                String::new()
            };
            return Err(ConfigError::UnknownKey {
                path: path.to_path_buf(),
                key,
                hint,
                accepted: accepted.join(", "),
            });
        };
        let switch = matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse);
        let values: Vec<String> = match arg.get_action() {
            ArgAction::SetTrue | ArgAction::SetFalse => match value {
                toml::Value::Boolean(b) => vec![b.to_string()],
                _ => return Err(bad("a switch: expected true or false".into())),
            },
            ArgAction::Append => match &value {
                toml::Value::Array(items) => items
                    .iter()
                    .map(|v| scalar(v).ok_or_else(|| bad(expected_list())))
                    .collect::<Result<_, _>>()?,
                v => vec![scalar(v).ok_or_else(|| bad(expected_list()))?],
            },
            _ => vec![scalar(&value).ok_or_else(|| {
                bad("expected a string or a number (one value; tables and arrays are not accepted)".into())
            })?],
        };
        if !switch {
            // Each value goes through the flag's own parser, as if given
            // alone on the command line; only the value's own errors count
            // here (a flag that needs another is settled by the real parse).
            for w in &values {
                let probe = [cmd.get_name().to_string(), format!("--{key}={w}")];
                if let Err(e) = cmd.clone().try_get_matches_from(probe) {
                    use clap::error::ErrorKind::{InvalidValue, ValueValidation};
                    if matches!(e.kind(), InvalidValue | ValueValidation) {
                        return Err(bad(clap_message(&e, &arg)));
                    }
                }
            }
        }
        let words = if switch {
            // SetTrue: present means true; SetFalse: present means false.
            let on = values[0] == "true";
            let set_true = matches!(arg.get_action(), ArgAction::SetTrue);
            if on == set_true {
                vec![format!("--{key}")]
            } else {
                Vec::new()
            }
        } else {
            values.iter().map(|v| format!("--{key}={v}")).collect()
        };
        out.push(FileValue {
            id: arg.get_id().clone(),
            words,
        });
    }
    Ok(out)
}

/// `args` (the program name first) with the file's words put before the
/// rest for every flag `args` does not give itself.
pub fn merge(cmd: &Command, args: Vec<OsString>, file: &[FileValue]) -> Vec<OsString> {
    // Which flags the command line gives: a lenient parse of it alone (a
    // mistake in it is reported by the real parse that follows).
    let given: Vec<clap::Id> = match cmd.clone().ignore_errors(true).try_get_matches_from(&args) {
        Ok(m) => m
            .ids()
            .filter(|id| m.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine))
            .cloned()
            .collect(),
        Err(_) => Vec::new(),
    };
    let mut it = args.into_iter();
    let mut merged: Vec<OsString> = it.next().into_iter().collect();
    for v in file.iter().filter(|v| !given.contains(&v.id)) {
        merged.extend(v.words.iter().map(OsString::from));
    }
    merged.extend(it);
    merged
}

/// Parses `args` (the program name first) for the clap command `T`, with
/// the configuration file `--config` names, or `default` if it exists.
/// Returns the parsed value and the file read, if any.
pub fn parse_from<T>(args: Vec<OsString>, default: &Path) -> Result<(T, Option<PathBuf>), Error>
where
    T: clap::CommandFactory + clap::FromArgMatches,
{
    let file = chosen_file(&args, default)?;
    let cmd = with_config_flag(T::command(), default);
    let args = match &file {
        Some(f) => merge(&cmd, args, &read_file(&cmd, f)?),
        None => args,
    };
    let matches = cmd.try_get_matches_from(args)?;
    let value = T::from_arg_matches(&matches)?;
    Ok((value, file))
}

/// [`parse_from`] on the process's arguments; on an error prints it and
/// exits as clap does (status 2; 0 for `--help` and `--version`).
pub fn parse_or_exit<T>(default: &Path) -> (T, Option<PathBuf>)
where
    T: clap::CommandFactory + clap::FromArgMatches,
{
    match parse_from(std::env::args_os().collect(), default) {
        Ok(v) => v,
        Err(Error::Clap(e)) => e.exit(),
        Err(Error::Config(e)) => {
            let name = T::command().get_name().to_string();
            eprintln!("{name}: {e}");
            std::process::exit(2);
        }
    }
}

/// Why [`parse_from`] failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration file.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The command line (or `--help`/`--version`, which clap reports this way).
    #[error(transparent)]
    Clap(#[from] clap::Error),
}

fn expected_list() -> String {
    "a repeatable flag: expected a string or an array of strings".into()
}

/// A TOML scalar as the word the command line would carry.
fn scalar(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        _ => None,
    }
}

/// clap's complaint about one value, without its "error:" prefix and the
/// usage lines, and with the possible values when the flag has a list.
fn clap_message(e: &clap::Error, arg: &Arg) -> String {
    let text = e.to_string();
    let first = text.lines().next().unwrap_or_default();
    let mut m = first.strip_prefix("error: ").unwrap_or(first).to_string();
    let possible: Vec<String> = arg
        .get_possible_values()
        .iter()
        .map(|p| p.get_name().to_string())
        .collect();
    if !possible.is_empty() {
        m.push_str(&format!(" (accepted: {})", possible.join(", ")));
    }
    m
}

/// clap (without its `string` feature) keeps help as `&'static str`. A
/// daemon builds its command once at start-up (tests a few times), so this
/// one short string is leaked on purpose.
fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// A daemon's flags in small.
    #[derive(Debug, Parser)]
    #[command(name = "toy")]
    struct Toy {
        #[arg(long, default_value = "127.0.0.1:7700")]
        listen: std::net::SocketAddr,
        #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
        reconcile_ms: u64,
        #[arg(long)]
        lcores: Option<usize>,
        #[arg(long)]
        busy_poll: bool,
        #[arg(long)]
        appliance: Vec<String>,
        #[arg(long, value_enum, default_value = "udp")]
        backend: Kind,
        #[arg(long, requires = "key")]
        cert: Option<String>,
        #[arg(long, requires = "cert")]
        key: Option<String>,
        #[arg(long, allow_hyphen_values = true)]
        eal: Option<String>,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
    enum Kind {
        Udp,
        Dpdk,
    }

    fn file(text: &str) -> tempfile_lite::TempFile {
        tempfile_lite::TempFile::new(text)
    }

    fn parse(args: &[&str]) -> Result<Toy, Error> {
        let args = std::iter::once("toy")
            .chain(args.iter().copied())
            .map(OsString::from)
            .collect();
        parse_from::<Toy>(args, Path::new("/nonexistent/toy.toml")).map(|(t, _)| t)
    }

    #[test]
    fn file_values_are_used_and_the_command_line_overrides_them() {
        let f = file(
            "listen = \"0.0.0.0:9000\"\nreconcile-ms = 50\nlcores = 3\nbusy-poll = true\n\
             appliance = [\"name=a,url=http://x\", \"name=b,url=http://y\"]\nbackend = \"dpdk\"\n",
        );
        let c = f.path();
        let t = parse(&["--config", c]).unwrap();
        assert_eq!(t.listen.to_string(), "0.0.0.0:9000");
        assert_eq!((t.reconcile_ms, t.lcores, t.busy_poll), (50, Some(3), true));
        assert_eq!(t.appliance.len(), 2);
        assert_eq!(t.backend, Kind::Dpdk);
        let t = parse(&[
            &format!("--config={c}"),
            "--reconcile-ms",
            "7",
            "--appliance",
            "name=c,url=http://z",
            "--backend",
            "udp",
        ])
        .unwrap();
        assert_eq!(t.reconcile_ms, 7);
        assert_eq!(t.appliance, vec!["name=c,url=http://z".to_string()]);
        assert_eq!(t.backend, Kind::Udp);
        assert_eq!(t.lcores, Some(3));
        // A flag that needs another: one from the file, one from the
        // command line; values that look like flags.
        let g = file("cert = \"a.crt\"\nkey = \"a.key\"\neal = \"--no-pci -m 512\"\n");
        let t = parse(&["--config", g.path(), "--cert", "b.crt"]).unwrap();
        assert_eq!(
            (t.cert.as_deref(), t.key.as_deref()),
            (Some("b.crt"), Some("a.key"))
        );
        assert_eq!(t.eal.as_deref(), Some("--no-pci -m 512"));
        // A switch set false is no word; the command line's mistakes are
        // clap's own.
        let h = file("busy-poll = false\n");
        assert!(!parse(&["--config", h.path()]).unwrap().busy_poll);
        assert!(matches!(
            parse(&["--config", h.path(), "--lcores", "x"]),
            Err(Error::Clap(_))
        ));
        // No file: clap's defaults.
        let t = parse(&[]).unwrap();
        assert_eq!((t.reconcile_ms, t.lcores, t.busy_poll), (2000, None, false));
    }

    #[test]
    fn mistakes_name_the_file_the_key_and_what_is_accepted() {
        let err = |text: &str| {
            let f = file(text);
            match parse(&["--config", f.path()]) {
                Err(Error::Config(e)) => (e.to_string(), f.path().to_string()),
                other => panic!("{text:?}: expected a configuration error, got {other:?}"),
            }
        };
        let (e, p) = err("reconcile_ms = 5\n");
        assert!(
            e.contains(&p) && e.contains("`reconcile_ms`") && e.contains("`reconcile-ms`"),
            "{e}"
        );
        let (e, _) = err("colour = 5\n");
        assert!(
            e.contains("unknown key `colour`") && e.contains("busy-poll"),
            "{e}"
        );
        let (e, _) = err("reconcile-ms = 0\n");
        assert!(e.contains("`reconcile-ms` = 0") && e.contains("1.."), "{e}");
        let (e, _) = err("backend = \"tcp\"\n");
        assert!(e.contains("accepted: udp, dpdk"), "{e}");
        let (e, _) = err("busy-poll = \"yes\"\n");
        assert!(e.contains("expected true or false"), "{e}");
        let (e, _) = err("listen = [\"a\"]\n");
        assert!(e.contains("one value"), "{e}");
        let (e, _) = err("listen = \n");
        assert!(e.contains("not valid TOML"), "{e}");
        let (e, _) = err("config = \"x\"\n");
        assert!(e.contains("unknown key `config`"), "{e}");
        assert!(matches!(
            parse(&["--config", "/nonexistent/x.toml"]),
            Err(Error::Config(ConfigError::Read { .. }))
        ));
        assert!(matches!(
            parse(&["--config"]),
            Err(Error::Config(ConfigError::MissingPath))
        ));
    }

    #[test]
    fn the_default_file_is_read_if_it_exists_unless_the_environment_says_not() {
        let f = file("lcores = 2\n");
        let default = Path::new(f.path());
        let args = vec![OsString::from("toy")];
        // `make test` sets it for the whole run (so that an installed
        // package's /etc/phub stays out of the tests); this test says what
        // happens both ways, and puts it back as it found it.
        let outer = std::env::var_os(NO_SYSTEM_CONFIG_ENV);
        std::env::remove_var(NO_SYSTEM_CONFIG_ENV);
        assert_eq!(chosen_file(&args, default).unwrap().as_deref(), Some(default));
        assert_eq!(
            chosen_file(&args, Path::new("/nonexistent/toy.toml")).unwrap(),
            None
        );
        // The only test that sets it (the others name no default that exists).
        std::env::set_var(NO_SYSTEM_CONFIG_ENV, "1");
        let skipped = chosen_file(&args, default).unwrap();
        let explicit = chosen_file(&[args[0].clone(), "--config".into(), f.path().into()], default).unwrap();
        match outer {
            Some(v) => std::env::set_var(NO_SYSTEM_CONFIG_ENV, v),
            None => std::env::remove_var(NO_SYSTEM_CONFIG_ENV),
        }
        assert_eq!(skipped, None);
        assert_eq!(explicit.as_deref(), Some(default));
    }

    /// A temporary file without a dependency for it.
    mod tempfile_lite {
        pub(super) struct TempFile(std::path::PathBuf);
        impl TempFile {
            pub(super) fn new(text: &str) -> TempFile {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "phub-conf-test-{}-{}.toml",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::write(&p, text).unwrap();
                TempFile(p)
            }
            pub(super) fn path(&self) -> &str {
                self.0.to_str().unwrap()
            }
        }
        impl Drop for TempFile {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
    }
}
