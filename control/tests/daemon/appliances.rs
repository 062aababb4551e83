//! phub-control with several appliances: a real `Daemon` on 127.0.0.1:0
//! against two fake dataplanes, driven over HTTP. Appliances added, listed
//! and removed (refused while a job uses one), recorded in the state file;
//! jobs sharded over both, each holding only its part.

// Not every test file uses every part of the fake.
#[allow(dead_code)]
use std::path::Path;
use std::time::Duration;

use crate::client::{err_at, ok_at, send, wait_for};
use crate::fake::{Fake, FakeConfig, TempState};
use phub_control::daemon::{Config, Daemon};
use phub_proto::api::{
    AdmitResponse, ApplianceSpec, ApplianceStatus, JobDetail, JobMap, JobSummary, JoinResponse, Stats,
};
use phub_proto::layout::Placement;
use phub_proto::routes::{AddMode, ControlRoute as R, Route, RouteError};
use phub_proto::spec::{Appliances as Placed, JobSpec};

fn temp_state(tag: &str) -> TempState {
    TempState::new("phub-control-appl", tag)
}

fn appliance(name: &str, fake: &Fake, rack: &str) -> ApplianceSpec {
    ApplianceSpec {
        name: name.into(),
        url: fake.url(),
        rack: rack.into(),
        token_file: None,
        draining: false,
    }
}

/// A daemon over `appliances` (none: `dataplane` as "default") and `state`.
fn daemon(appliances: Vec<ApplianceSpec>, dataplane: &str, state: &Path) -> Daemon {
    Daemon::start(Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        dataplane: dataplane.to_string(),
        appliances,
        state: state.to_path_buf(),
        reconcile_interval: Duration::from_millis(100),
        ..Config::default()
    })
    .unwrap()
}

fn list(d: &Daemon) -> Vec<ApplianceStatus> {
    ok_at(d, &R::Appliances, None)
}

fn jobs(d: &Daemon) -> Vec<JobSummary> {
    ok_at(d, &R::Jobs, None)
}

/// Two one-lcore fakes, `a` in rack r1 and `b` in r2, under a daemon on
/// a state file tagged `tag`.
fn two_appliances(tag: &str) -> (Fake, Fake, TempState, Daemon) {
    let a = Fake::start(FakeConfig::lcores(1));
    let b = Fake::start(FakeConfig::lcores(1).at(9200));
    let state = temp_state(tag);
    let d = daemon(
        vec![appliance("a", &a, "r1"), appliance("b", &b, "r2")],
        "http://127.0.0.1:1",
        &state,
    );
    (a, b, state, d)
}

/// A sum job of one key of `elements` f32 in 1 KiB chunks, on `placement`.
fn spec(name: &str, elements: u64, placement: Option<Placed>) -> String {
    let spec = JobSpec::new(name, 2, &[elements]).with_chunk_bytes(1024);
    match placement {
        Some(p) => spec.sharded_over(p),
        None => spec,
    }
    .to_toml()
}

fn puts(fake: &Fake) -> usize {
    fake.state
        .lock()
        .unwrap()
        .log
        .iter()
        .filter(|l| l.starts_with("PUT"))
        .count()
}

#[test]
fn appliances_are_added_listed_removed_and_recorded() {
    let a = Fake::start(FakeConfig::lcores(2));
    let b = Fake::start(FakeConfig::lcores(3).at(9200));
    let state = temp_state("crud");
    let d = daemon(vec![appliance("a", &a, "r1")], "http://127.0.0.1:1", &state);
    let l = list(&d);
    assert_eq!(l.len(), 1);
    assert_eq!(
        (l[0].name.as_str(), l[0].rack.as_str(), l[0].lcores),
        ("a", "r1", Some(2))
    );
    assert!(l[0].down.is_none());

    let body = serde_json::to_string(&appliance("b", &b, "r2")).unwrap();
    let (s, _) = send(
        &d,
        "POST",
        &R::AddAppliance {
            mode: AddMode::Checked,
        }
        .path(),
        Some(&body),
        false,
    );
    assert_eq!(s, 401, "adding an appliance needs the operator token");
    let added: ApplianceStatus = ok_at(
        &d,
        &R::AddAppliance {
            mode: AddMode::Checked,
        },
        Some(&body),
    );
    assert_eq!((added.name.as_str(), added.lcores), ("b", Some(3)));
    let e = err_at(
        &d,
        &R::AddAppliance {
            mode: AddMode::Checked,
        },
        Some(&body),
        409,
    );
    assert!(e.contains("appliance \"b\" already exists"), "{e}");
    let bad = serde_json::to_string(&ApplianceSpec {
        name: "../x".into(),
        ..appliance("x", &b, "")
    })
    .unwrap();
    let e = err_at(
        &d,
        &R::AddAppliance {
            mode: AddMode::Checked,
        },
        Some(&bad),
        400,
    );
    assert!(
        e.contains("appliance name \"../x\"") && e.contains("ASCII letters"),
        "{e}"
    );
    assert_eq!(list(&d).len(), 2);

    let r: AdmitResponse = ok_at(
        &d,
        &R::Admit,
        Some(&spec("both", 256 * 10, Some(Placed::named(&["a", "b"])))),
    );
    assert_eq!(r.appliances, ["a", "b"]);
    let e = err_at(&d, &R::RemoveAppliance { name: "b".into() }, None, 409);
    assert!(
        e.contains("appliance \"b\" holds jobs 1 (\"both\"); evict them first"),
        "{e}"
    );
    assert_eq!(
        err_at(&d, &R::RemoveAppliance { name: "zz".into() }, None, 404),
        "no appliance \"zz\"; see phubctl appliance list"
    );

    // Restarted without --appliance: the state file knows both, and where
    // the job is.
    d.shutdown();
    let d = daemon(vec![], "http://127.0.0.1:1", &state);
    let names: Vec<String> = list(&d).into_iter().map(|a| a.name).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(list(&d)[1].jobs, [1]);
    wait_for("the job installed on both", || jobs(&d)[0].installed);
    assert_eq!(jobs(&d)[0].appliances, ["a", "b"]);

    let _: JobSummary = ok_at(&d, &R::Evict { job: 1 }, None);
    assert!(a.jobs().is_empty() && b.jobs().is_empty(), "evicted from both");
    let gone: ApplianceStatus = ok_at(&d, &R::RemoveAppliance { name: "b".into() }, None);
    assert_eq!(gone.name, "b");
    d.shutdown();
    let d = daemon(vec![], "http://127.0.0.1:1", &state);
    let names: Vec<String> = list(&d).into_iter().map(|a| a.name).collect();
    assert_eq!(names, ["a"], "the removal was recorded");
    d.shutdown();
}

/// A state file of the version before appliances: its jobs are on the
/// appliance "default", which is --dataplane.
#[test]
fn a_state_file_without_appliances_means_one_appliance_default() {
    let fake = Fake::start(FakeConfig::lcores(2));
    let state = temp_state("old");
    let d = daemon(vec![], &fake.url(), &state);
    let _: AdmitResponse = ok_at(&d, &R::Admit, Some(&spec("old", 5000, None)));
    d.shutdown();
    let mut old: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(old["appliances"][0]["name"], "default");
    old.as_object_mut().unwrap().remove("appliances");
    old["jobs"][0].as_object_mut().unwrap().remove("parts");
    std::fs::write(&state, old.to_string()).unwrap();
    fake.forget_all();
    let d = daemon(vec![], &fake.url(), &state);
    wait_for("the job reinstalled on default", || fake.jobs().contains_key(&1));
    assert_eq!(jobs(&d)[0].appliances, ["default"]);
    assert_eq!(list(&d)[0].name, "default");
    d.shutdown();
    // A job on an appliance nobody names stops the start, naming it.
    let mut text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    text["jobs"][0]["parts"][0]["appliance"] = "gone".into();
    std::fs::write(&state, text.to_string()).unwrap();
    let e = Daemon::start(Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        dataplane: fake.url(),
        state: state.to_path_buf(),
        ..Config::default()
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("job 1 is on appliance \"gone\", which neither the state file nor the command line names"),
        "{e}"
    );
}

#[test]
fn a_job_over_two_appliances_holds_a_part_on_each() {
    let a = Fake::start(FakeConfig {
        budget: 1 << 20,
        ..FakeConfig::lcores(2)
    });
    let b = Fake::start(FakeConfig::lcores(3).at(9200));
    let state = temp_state("shard");
    let d = daemon(
        vec![appliance("a", &a, "r1"), appliance("b", &b, "r2")],
        "http://127.0.0.1:1",
        &state,
    );
    // One appliance by default: the one with the most free memory.
    let one: AdmitResponse = ok_at(&d, &R::Admit, Some(&spec("one", 1000, None)));
    assert_eq!(one.appliances, ["b"]);
    assert!(b.jobs().contains_key(&one.id) && !a.jobs().contains_key(&one.id));
    let _: JobSummary = ok_at(&d, &R::Evict { job: one.id }, None);

    let e = err_at(&d, &R::Admit, Some(&spec("x", 1000, Some(Placed::Count(3)))), 507);
    assert_eq!(e, "the job asks for 3 appliances; 2 answer: a, b");
    let e = err_at(
        &d,
        &R::Admit,
        Some(&spec("x", 1000, Some(Placed::named(&["c"])))),
        400,
    );
    assert!(
        e.contains("names \"c\", which control does not manage; its appliances: a, b"),
        "{e}"
    );
    // Too big for a's 1 MiB: refused, naming a, and nothing left anywhere.
    let e = err_at(
        &d,
        &R::Admit,
        Some(&spec("big", 1 << 20, Some(Placed::Count(2)))),
        507,
    );
    assert!(
        e.starts_with("job needs ") && e.contains(" on appliance \"a\"; the dataplane has "),
        "{e}"
    );
    assert!(a.jobs().is_empty() && b.jobs().is_empty());

    let r: AdmitResponse = ok_at(
        &d,
        &R::Admit,
        Some(&spec("both", 256 * 10, Some(Placed::Count(2)))),
    );
    assert_eq!(r.appliances, ["b", "a"], "most free memory first");
    let (on_a, on_b) = (a.jobs()[&r.id].layout.clone(), b.jobs()[&r.id].layout.clone());
    assert_eq!((on_b.lcores.len(), on_a.lcores.len()), (3, 2));
    assert_eq!((on_b.span().start, on_b.span().end), (0, on_a.span().start));
    assert_eq!(on_a.span().end, 10);
    assert!(on_a.chunk_count() > 0 && on_b.chunk_count() > 0);

    // A worker learns both appliances and a layout over their 5 lcores.
    let join: JoinResponse = ok_at(
        &d,
        &R::Join { job: r.id },
        Some(&format!("{{\"token\": \"{:016x}\", \"rank\": 0}}", r.token)),
    );
    let names: Vec<(&str, u32)> = join
        .appliances
        .iter()
        .map(|a| (a.name.as_str(), a.lcores))
        .collect();
    assert_eq!(names, [("b", 3), ("a", 2)]);
    // Each appliance states the smallest receive buffer of its lcores
    // (the fake's lcore i has FAKE_RX_BUFFER >> i), which the worker's
    // window must fit.
    let rx: Vec<Option<u64>> = join.appliances.iter().map(|a| a.rx_buffer_bytes).collect();
    assert_eq!(
        rx,
        [
            Some(crate::fake::FAKE_RX_BUFFER >> 2),
            Some(crate::fake::FAKE_RX_BUFFER >> 1)
        ]
    );
    let whole = Placement::new(&join.spec, join.layout.clone()).unwrap();
    assert_eq!(join.layout.lcores[..3], on_b.lcores[..]);
    assert_eq!(join.layout.lcores[3..], on_a.lcores[..]);
    assert_eq!(whole.chunks().total(), 10);

    let map: JobMap = ok_at(
        &d,
        &R::Map {
            job: r.id,
            key: Some(0),
        },
        None,
    );
    let owners: Vec<&str> = map.lcores.iter().map(|l| l.appliance.as_str()).collect();
    assert!(owners.contains(&"a") && owners.contains(&"b"), "{owners:?}");
    assert_eq!(map.keys[0].runs.iter().map(|r| r.count).sum::<u32>(), 10);
    assert!(map.keys[0].runs.iter().any(|r| r.appliance == "a" && r.slot == 0));

    let show: JobDetail = ok_at(&d, &R::Job { job: r.id }, None);
    assert!(show.summary.installed);
    let parts: Vec<(&str, &str, bool)> = show
        .parts
        .iter()
        .map(|p| (p.appliance.as_str(), p.rack.as_str(), p.installed))
        .collect();
    assert_eq!(parts, [("b", "r2", true), ("a", "r1", true)]);
    // The fake says 42 rounds per job: both parts count.
    assert_eq!(show.rounds_completed, 84);
    let stats: Stats = ok_at(&d, &R::Stats, None);
    assert_eq!(stats.appliances.len(), 2);

    // Checkpoints: one file per part.
    let c: phub_proto::api::CheckpointInfo = ok_at(&d, &R::Checkpoint { job: r.id }, None);
    for name in ["a", "b"] {
        let f = state.with_file_name(format!("state.json.job-{}.{name}.ckpt", r.id));
        assert!(
            f.exists() && c.file.contains(&f.display().to_string()),
            "{}",
            c.file
        );
    }

    // Appliance a loses its jobs: its part alone is restored there from
    // its checkpoint; b is not touched.
    let b_puts = puts(&b);
    a.forget_all();
    wait_for("a's part restored", || {
        a.state.lock().unwrap().restored.contains_key(&r.id)
    });
    assert_eq!(a.jobs()[&r.id].layout, on_a);
    assert_eq!(puts(&b), b_puts);
    // Evicted: from both.
    let evicted: JobSummary = ok_at(&d, &R::Evict { job: r.id }, None);
    assert_eq!(evicted.appliances, ["b", "a"]);
    assert!(a.jobs().is_empty() && b.jobs().is_empty());
    d.shutdown();
}

/// A hierarchical job's workers send to their rack's appliance only, so
/// their share of its receive buffer counts the rack's ranks, beside the
/// racks' appliances sending partial sums to its home slots, not all W.
#[test]
fn a_hierarchical_jobs_share_counts_the_ranks_of_its_rack() {
    let (_a, _b, _state, d) = two_appliances("hier-share");
    let spec = "name = \"h\"\nworkers = 4\nchunk_bytes = 1024\n[optimizer]\nkind = \"sum\"\n\
                [[keys]]\nelements = 2560\n[placement]\nappliances = [\"a\", \"b\"]\n\
                hierarchical = true\nranks_per_rack = [1, 3]\n";
    let r: AdmitResponse = ok_at(&d, &R::Admit, Some(spec));
    let share = |rank: u16| {
        let join: JoinResponse = ok_at(
            &d,
            &R::Join { job: r.id },
            Some(&format!("{{\"token\": \"{:016x}\", \"rank\": {rank}}}", r.token)),
        );
        assert_eq!(join.appliances.len(), 1, "a rank talks to its rack's appliance");
        (
            join.appliances[0].name.clone(),
            join.appliances[0].rx_buffer_bytes,
        )
    };
    // On each one-lcore appliance: its rack's ranks, and the 2 racks'
    // partials to the home slots there.
    let buf = crate::fake::FAKE_RX_BUFFER;
    assert_eq!(share(0), ("a".to_string(), Some(buf / 3)));
    assert_eq!(share(1), ("b".to_string(), Some(buf * 3 / 5)));
    d.shutdown();
}

/// An appliance that does not answer: job show names it per part.
#[test]
fn job_show_names_a_part_whose_appliance_is_down() {
    let (_a, b, _state, d) = two_appliances("down");
    let r: AdmitResponse = ok_at(
        &d,
        &R::Admit,
        Some(&spec("both", 256 * 4, Some(Placed::named(&["a", "b"])))),
    );
    drop(b);
    let show: JobDetail = ok_at(&d, &R::Job { job: r.id }, None);
    assert!(!show.summary.installed);
    let down = &show.parts[1];
    assert_eq!(down.appliance, "b");
    assert!(!down.installed);
    assert!(
        down.down
            .as_deref()
            .unwrap()
            .contains("cannot reach the dataplane"),
        "{down:?}"
    );
    assert!(show.parts[0].installed && show.parts[0].down.is_none());
    let text = phub_control::cli::render_show(&show);
    assert!(
        text.contains("DOWN (") && text.contains("reinstalled when it answers"),
        "{text}"
    );
    d.shutdown();
}

/// Issue 36, finding 1: one dataplane managed under two names (given as
/// `--appliance a=...` and `--appliance a2=...` with one URL, or kept so
/// in the state file) lost its jobs: within one reconcile period the
/// second name's reconciliation removed every job as "not admitted
/// there", the first's reinstalled them empty, and the two looped. Now
/// the second name is known by the dataplane's id and data address for
/// an alias of the first: it is neither reconciled nor chosen for a job,
/// and `appliance list` says so; the job is never removed nor reinstalled.
#[test]
fn one_dataplane_under_two_names_loses_no_job() {
    let a = Fake::start(FakeConfig::lcores(2));
    let state = temp_state("alias");
    let d = daemon(
        vec![appliance("a", &a, "r1"), appliance("a2", &a, "r2")],
        "http://127.0.0.1:1",
        &state,
    );
    let r: AdmitResponse = ok_at(
        &d,
        &R::Admit,
        Some(&spec("kept", 5000, Some(Placed::named(&["a"])))),
    );
    wait_for("a2 shown as a's dataplane", || {
        list(&d).iter().any(|x| {
            x.name == "a2"
                && x.down
                    .as_deref()
                    .is_some_and(|w| w.contains("dataplane of appliance \"a\" under a second name"))
        })
    });
    let puts_before = puts(&a);
    // Several reconcile periods (100 ms each).
    std::thread::sleep(Duration::from_millis(800));
    assert!(a.jobs().contains_key(&r.id), "the job stays installed");
    assert_eq!(puts(&a), puts_before, "and is not reinstalled");
    let deletes: Vec<String> = a
        .state
        .lock()
        .unwrap()
        .log
        .iter()
        .filter(|l| l.starts_with("DELETE"))
        .cloned()
        .collect();
    assert!(deletes.is_empty(), "{deletes:?}");
    let e = err_at(
        &d,
        &R::Admit,
        Some(&spec("x", 256, Some(Placed::named(&["a2"])))),
        409,
    );
    assert!(e.contains("\"a2\"") && e.contains("second name"), "{e}");
    d.shutdown();
}

/// Issue 36, findings 1 and 5: `appliance add` took any URL: a second name
/// for a managed dataplane (the same URL with a trailing `/`, `localhost`
/// for `127.0.0.1`), a wrong management token (shown "up": only the open
/// `/v1/info` was called), a URL where nothing answers, and control's own
/// URL, each with exit 0. Now each is refused, naming why (the first
/// appliance, the token file, `--force`, "not a phub dataplane"); only a
/// dataplane that is down may be added, with `--force`.
#[test]
fn appliance_add_checks_what_it_adds() {
    let a = Fake::start(FakeConfig::lcores(1));
    let b = Fake::start(FakeConfig::lcores(1).at(9200));
    let state = temp_state("add-checks");
    let d = daemon(vec![appliance("a", &a, "r1")], "http://127.0.0.1:1", &state);
    let add = |spec: &ApplianceSpec, mode: AddMode, status: u16| -> String {
        let body = serde_json::to_string(spec).unwrap();
        err_at(&d, &R::AddAppliance { mode }, Some(&body), status)
    };
    let port = a.addr.port();
    for url in [
        format!("http://127.0.0.1:{port}/"),
        format!("http://localhost:{port}"),
        format!("http://LOCALHOST:{port}//"),
    ] {
        let spec = ApplianceSpec {
            url: url.clone(),
            ..appliance("a2", &a, "r2")
        };
        let e = add(&spec, AddMode::Checked, 409);
        assert!(
            e.contains("appliance \"a\"") && e.contains("one name"),
            "{url}: {e}"
        );
        let e = add(&spec, AddMode::Forced, 409);
        assert!(e.contains("appliance \"a\""), "{url} --force: {e}");
    }
    // Another dataplane whose data address is a's: one of the two is
    // wrong, and workers would send to the other.
    let c = Fake::start(FakeConfig::lcores(1));
    let e = add(&appliance("c", &c, "r3"), AddMode::Checked, 409);
    assert!(
        e.contains("appliance \"a\"") && e.contains("same data address 127.0.0.1:9100"),
        "{e}"
    );
    let wrong = state.with_extension("wrong-token");
    std::fs::write(&wrong, "0123456789abcdef0123456789abcdef\n").unwrap();
    let mut perms = std::fs::metadata(&wrong).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o600);
    std::fs::set_permissions(&wrong, perms).unwrap();
    let e = add(
        &ApplianceSpec {
            token_file: Some(wrong.display().to_string()),
            ..appliance("b", &b, "r2")
        },
        AddMode::Checked,
        400,
    );
    assert!(
        e.contains("management token in") && e.contains("does not open the dataplane"),
        "{e}"
    );
    let nothing = format!("http://127.0.0.1:{}", free_port());
    let down = ApplianceSpec {
        url: nothing.clone(),
        ..appliance("gone", &b, "r3")
    };
    let e = add(&down, AddMode::Checked, 400);
    assert!(e.contains("cannot reach") && e.contains("--force"), "{e}");
    let own = ApplianceSpec {
        url: format!("http://{}", d.addr()),
        ..appliance("me", &b, "r3")
    };
    let e = add(&own, AddMode::Checked, 400);
    assert!(e.contains("does not answer as a phub dataplane"), "{e}");
    assert_eq!(list(&d).len(), 1, "nothing was added");
    let body = serde_json::to_string(&down).unwrap();
    let added: ApplianceStatus = ok_at(
        &d,
        &R::AddAppliance {
            mode: AddMode::Forced,
        },
        Some(&body),
    );
    assert_eq!(added.name, "gone");
    assert!(added.down.is_some());
    let _: ApplianceStatus = ok_at(
        &d,
        &R::AddAppliance {
            mode: AddMode::Checked,
        },
        Some(&serde_json::to_string(&appliance("b", &b, "r2")).unwrap()),
    );
    let names: Vec<String> = list(&d).into_iter().map(|a| a.name).collect();
    assert_eq!(names, ["a", "b", "gone"]);
    let _ = std::fs::remove_file(&wrong);
    d.shutdown();
}

/// A free TCP port on 127.0.0.1 (nothing listens there once it returns).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Issue 36, finding 6: a hierarchical job failed because one of its
/// appliances came back with another lcore count kept its part on the
/// other appliance installed, holding memory and sending partials to a
/// home that is gone. Now that part is removed when the job fails.
#[test]
fn a_failed_hierarchical_job_leaves_no_part_behind() {
    let (a, b, _state, d) = two_appliances("hier-fail");
    let spec = "name = \"h\"\nworkers = 2\nchunk_bytes = 1024\n[optimizer]\nkind = \"sum\"\n\
                [[keys]]\nelements = 2560\n[placement]\nappliances = [\"a\", \"b\"]\n\
                hierarchical = true\n";
    let r: AdmitResponse = ok_at(&d, &R::Admit, Some(spec));
    assert!(a.jobs().contains_key(&r.id) && b.jobs().contains_key(&r.id));
    b.restart_as(FakeConfig::lcores(2).at(9200));
    wait_for("the job failed", || jobs(&d)[0].failed.is_some());
    let why = jobs(&d)[0].failed.clone().unwrap();
    assert!(why.contains("came back with 2 lcores"), "{why}");
    wait_for("its part on a removed", || a.jobs().is_empty());
    assert!(b.jobs().is_empty());
    d.shutdown();
}

/// Every route `phub_proto::routes::ControlRoute` knows reaches its
/// handler in the daemon: sent as a client sends it (method, path and
/// query), each gets its handler's answer, never the router's refusal (404
/// "no route", 405, or a malformed id's 400). The forced add's 201 shows
/// the query reaches the route too (without `?force=true` the same add is
/// refused: the appliance does not answer).
#[test]
fn every_route_reaches_its_handler() {
    let a = Fake::start(FakeConfig::lcores(1));
    let state = temp_state("every-route");
    let d = daemon(vec![appliance("a", &a, "r1")], "http://127.0.0.1:1", &state);
    let spec = "name = \"r\"\nworkers = 1\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 64\n";
    let job: AdmitResponse = ok_at(&d, &R::Admit, Some(spec));
    let down = serde_json::to_string(&ApplianceSpec {
        url: "http://127.0.0.1:1".into(),
        ..appliance("gone", &a, "r9")
    })
    .unwrap();
    let join = format!("{{\"token\": \"{:016x}\", \"rank\": 0}}", job.token);
    let second = spec.replace("\"r\"", "\"r2\"");
    let mut routes = R::every(job.id, "gone");
    // The eviction last, the forced add before the removal it makes room for.
    routes.sort_by_key(|r| match r {
        R::Evict { .. } => 2,
        R::RemoveAppliance { .. } => 1,
        _ => 0,
    });
    assert_eq!(routes.len(), 18);
    for route in routes {
        let (body, expected) = match &route {
            R::Admit => (Some(second.as_str()), 201),
            R::Join { .. } => (Some(join.as_str()), 200),
            R::AddAppliance {
                mode: AddMode::Checked,
            } => (Some(down.as_str()), 400),
            R::AddAppliance {
                mode: AddMode::Forced,
            } => (Some(down.as_str()), 201),
            // The job is not held: nothing to retry; nor replicated:
            // nothing to rebalance.
            R::Retry { .. } | R::Rebalance { .. } => (None, 409),
            R::Jobs
            | R::Job { .. }
            | R::Evict { .. }
            | R::Checkpoint { .. }
            | R::Map { .. }
            | R::Epoch { .. }
            | R::Stats
            | R::Appliances
            | R::RemoveAppliance { .. }
            // "gone" holds no job: nothing to move.
            | R::DrainAppliance { .. }
            | R::Metrics => (None, 200),
        };
        let (method, path) = (route.method().as_str(), route.path());
        let (status, text) = send(&d, method, &path, body, true);
        let refusal = RouteError::NotFound {
            method: method.into(),
            path: path.clone(),
        }
        .to_string();
        assert!(
            status != 405 && !text.contains(&refusal) && !text.contains("is not an integer from 1"),
            "{route:?}: the router refused {method} {path}: {status} {text}"
        );
        assert_eq!(status, expected, "{route:?}: {method} {path}: {text}");
    }
    let left: Vec<u16> = jobs(&d).iter().map(|j| j.id).collect();
    assert!(
        !left.contains(&job.id) && left.len() == 1,
        "the eviction went through: {left:?}"
    );
    d.shutdown();
}
