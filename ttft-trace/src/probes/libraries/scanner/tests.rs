//! The scanner's cache, its checks of a file's identity and its set-asides.

use super::*;
use crate::host::rootfs;

#[test]
fn every_mapped_file_is_remembered() {
    let me = std::process::id();
    let files = maps::mapped_files(me).expect("own maps");
    let mut scanner = Scanner::default();
    let scan = scanner.scan(me).expect("scan");
    assert!(scan.libraries.is_empty());
    assert_eq!(scanner.cache.len(), files.len(), "every file remembered");
}

#[test]
fn a_file_under_another_name_is_inspected_again() {
    if !crate::test_support::root_or_skip("a_file_under_another_name_is_inspected_again") {
        return;
    }
    let me = std::process::id();
    let mut scanner = Scanner::default();
    scanner.scan(me).expect("scan");
    // Mark every remembered file "denied": a rescan that trusts the
    // cache reports them all so.
    let keys: Vec<_> = scanner.cache.keys().copied().collect();
    assert!(keys.len() >= 2, "{keys:?}");
    for entry in scanner.cache.values_mut() {
        entry.seen = Seen::Denied;
    }
    // One seen under another name, as if a new file had its inode
    // number (another stamp); one only renamed (the same stamp).
    let (replaced, renamed) = (keys[0], keys[1]);
    for (key, restamp) in [(replaced, true), (renamed, false)] {
        let entry = scanner.cache.get_mut(&key).expect("remembered");
        entry.path ^= 1;
        if restamp {
            entry.stamp = entry.stamp.map(|s| Stamp {
                size: s.size + 1,
                ..s
            });
        }
    }
    let scan = scanner.scan(me).expect("rescan");
    assert_eq!(
        scan.denied.len(),
        keys.len() - 1,
        "all but one from the cache"
    );
    assert!(matches!(scanner.cache[&replaced].seen, Seen::Other));
    assert!(matches!(scanner.cache[&renamed].seen, Seen::Denied));
}

#[test]
fn a_mapping_replaced_under_the_scan_is_not_remembered() {
    if !crate::test_support::root_or_skip("a_mapping_replaced_under_the_scan_is_not_remembered") {
        return;
    }
    // A maps line whose device and inode are not those of the file its
    // mapping opens (the process remapped it meanwhile): nothing is
    // remembered under that key, so the next scan inspects the file.
    let me = std::process::id();
    let own = maps::mapped_files(me)
        .expect("own maps")
        .into_iter()
        .next()
        .expect("a mapped file");
    let remapped = maps::MappedFile {
        inode: own.inode + 1,
        ..own
    };
    assert!(inspect_mapped(&remapped).is_none());
}

#[test]
fn a_read_that_does_not_return_sets_the_process_and_file_aside() {
    let me = std::process::id();
    let mut scanner = Scanner::default();
    let (release, stalled) = std::sync::mpsc::channel::<()>();
    let r = scanner.off_loop(me, || Some((1, 2)), move || stalled.recv().is_ok());
    assert!(
        matches!(
            r,
            Err(LibraryError::Overdue {
                why: Overdue::Stalled(_),
                ..
            })
        ),
        "{r:?}"
    );
    let now = Instant::now();
    assert!(scanner.quarantine.holds(Target::Process(me), now));
    assert!(scanner.quarantine.holds(Target::File(1, 2), now));
    assert!(matches!(scanner.scan(me), Err(LibraryError::SetAside(p)) if p == me));
    let stats = scanner.read_stats();
    assert_eq!((stats.work.abandoned, stats.work.stuck_now), (1, 1));
    assert_eq!(stats.set_aside, 3, "pid and file backoffs, one stuck read");
    // Once the read returns, only the backoff holds them.
    drop(release);
    let deadline = Instant::now() + Duration::from_secs(5);
    while scanner.read_stats().work.stuck_now > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let later = Instant::now() + Duration::from_secs(2);
    assert!(!scanner.quarantine.holds(Target::Process(me), later));
}

#[test]
fn entries_not_found_lately_are_forgotten_libraries_unless_probed() {
    let exe = std::env::current_exe().expect("test binary path");
    let file = Arc::new(rootfs::open_regular_file(&exe).expect("open"));
    let lib = |ino| {
        Seen::Library(Arc::new(Library {
            path: exe.clone(),
            file: file.clone(),
            open_path: exe.clone(),
            id: FileId::Inode { dev: 1, ino },
            apis: Vec::new(),
            symbols: Vec::new(),
            tls: None,
        }))
    };
    let t0 = Instant::now();
    let entry = |seen, last_found| Entry {
        seen,
        path: 0,
        stamp: None,
        last_found,
    };
    let mut scanner = Scanner::default();
    // A library found at t0 + 100 s and two at t0 (one probed); files
    // that are no library found at t0 and at t0 + 100 s.
    let later = t0 + Duration::from_secs(100);
    scanner.cache.insert((1, 1), entry(lib(1), later));
    scanner.cache.insert((1, 2), entry(lib(2), t0));
    scanner.cache.insert((1, 3), entry(lib(3), t0));
    scanner.cache.insert((1, 4), entry(Seen::Other, t0));
    scanner.cache.insert((1, 5), entry(Seen::Denied, later));
    let probed = FileId::Inode { dev: 1, ino: 3 };
    let keep = |id: &FileId| *id == probed;
    let left = |s: &Scanner| {
        let mut keys: Vec<_> = s.cache.keys().copied().collect();
        keys.sort_unstable();
        keys
    };
    // 30 s after the later scan, libraries kept 60 s: the unprobed
    // library of t0 goes.
    let at = later + Duration::from_secs(30);
    assert_eq!(
        scanner.forget_unused_at(at, Duration::from_secs(60), keep),
        1
    );
    assert_eq!(left(&scanner), vec![(1, 1), (1, 3), (1, 4), (1, 5)]);
    // Past OTHER_FILE_AGE after t0: the other file of t0 goes, not
    // counted as a library.
    let at = t0 + OTHER_FILE_AGE;
    assert_eq!(
        scanner.forget_unused_at(at, Duration::from_secs(600), keep),
        0
    );
    assert_eq!(left(&scanner), vec![(1, 1), (1, 3), (1, 5)]);
    // Much later, only the probed library stays.
    let at = later + OTHER_FILE_AGE;
    assert_eq!(scanner.forget_unused_at(at, Duration::ZERO, keep), 1);
    assert_eq!(left(&scanner), vec![(1, 3)]);
}

#[test]
fn a_tenant_at_its_share_of_stuck_reads_is_not_read_until_one_returns() {
    let me = std::process::id();
    // Two processes of this test's tenant (its cgroup) whose reads stall.
    let mut children: Vec<_> = (0..2)
        .map(|_| {
            std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .expect("sleep")
        })
        .collect();
    let mut scanner = Scanner::default();
    let mut releases = Vec::new();
    for child in &children {
        let (release, stalled) = std::sync::mpsc::channel::<()>();
        releases.push(release);
        let r = scanner.off_loop(child.id(), || None, move || stalled.recv().is_ok());
        assert!(r.is_err(), "{r:?}");
    }
    // A third process of the tenant is not read; one of another is.
    let r = scanner.scan(me);
    assert!(
        matches!(r, Err(LibraryError::TenantStuck { pid, held: 2, .. }) if pid == me),
        "{r:?}"
    );
    assert_eq!(scanner.read_stats().stuck_share_refused, 1);
    let other = (1..me).find(|&p| {
        crate::host::targets::is_process(p)
            && Tenant::of_process(p).is_some_and(|t| Some(t) != Tenant::of_process(me))
    });
    if let Some(pid) = other {
        assert!(
            scanner.admit_tenant(pid).is_ok(),
            "pid {pid}: another tenant"
        );
    }
    // Once one returns, the tenant is under its share again.
    releases.pop();
    let deadline = Instant::now() + Duration::from_secs(5);
    while scanner
        .quarantine
        .stuck_of(&Tenant::of_process(me).expect("own tenant"))
        > 1
    {
        assert!(
            Instant::now() < deadline,
            "the released read never returned"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(scanner.scan(me).is_ok());
    assert_eq!(scanner.read_stats().stuck_share_refused, 1);
    for child in &mut children {
        let _ = child.kill();
        let _ = child.wait();
    }
}
