//! The safe layer against a real EAL with virtual devices (no hugepages, no
//! PCI): one EAL for this test binary, shared by its tests through the
//! init-once guard.

use std::sync::Once;

use phub_ffi::{eal, lcore, Eal, Mbuf, Mempool, PortBuilder, Ring};

/// The EAL of this test binary, or `None` (with the reason printed) where
/// DPDK cannot start here.
fn eal() -> Option<Eal> {
    static PRINT: Once = Once::new();
    let prefix = format!("phub-ffi-test-{}", std::process::id());
    let mut args = eal::standalone_args(&prefix, 256, "(0-2)@(0)");
    args.extend(["--vdev".to_string(), "net_null0".to_string()]);
    match eal::init(&args) {
        Ok(e) => Some(e),
        Err(e) => {
            PRINT.call_once(|| println!("SKIPPED: DPDK EAL cannot start here: {e}"));
            None
        }
    }
}

fn pool(eal: Eal, n: u32, room: u16) -> Mempool {
    Mempool::pktmbuf(eal, "t", n, 32, room, None).unwrap()
}

#[test]
fn init_twice_returns_the_same_eal() {
    let Some(e) = eal() else { return };
    let again = eal::init(&["--other"]).expect("second init reuses the first");
    assert_eq!(e.main_lcore(), again.main_lcore());
    assert!(eal::get().is_some());
    assert_eq!(e.worker_lcores(), vec![1, 2]);
}

#[test]
fn mbufs_append_chain_share_and_free() {
    let Some(e) = eal() else { return };
    let p = pool(e, 64, 2048 + phub_ffi::PKTMBUF_HEADROOM);
    let ind = pool(e, 64, 0);
    assert_eq!(p.in_use(), 0);
    let mut a = p.alloc().unwrap();
    assert!(a.extend_from_slice(b"header"));
    assert_eq!(a.data(), b"header");
    assert!(a.tailroom() >= 2000);
    let mut payload = p.alloc().unwrap();
    payload.append(5).unwrap().copy_from_slice(b"12345");
    assert!(!payload.extend_from_slice(&[0u8; 4096]), "does not fit");
    // Two indirect views of one payload: refcounted, read-only.
    let i1 = Mbuf::indirect(&ind, &payload).unwrap();
    let i2 = Mbuf::indirect(&ind, &payload).unwrap();
    assert_eq!(payload.refcnt(), 3);
    assert!(payload.data_mut().is_none(), "shared data is not writable");
    assert!(!i1.is_direct());
    assert_eq!(i2.data(), b"12345");
    let chain = a.chain(i1).unwrap();
    assert_eq!(chain.nb_segs(), 2);
    assert_eq!(chain.pkt_len(), 11);
    assert_eq!(chain.to_vec(), b"header12345");
    // A fresh mbuf attached in place: the same as an indirect one; one
    // that holds data (or is already indirect) is given back untouched.
    let i3 = ind.alloc().unwrap().attach(&payload).unwrap();
    assert_eq!((i3.data(), payload.refcnt()), (&b"12345"[..], 4));
    let i4 = ind.alloc().unwrap().attach(&i3).unwrap();
    assert_eq!(payload.refcnt(), 5, "attached to the owner of the data");
    let back = i4.attach(&payload).unwrap_err();
    assert!(!back.is_direct());
    let mut full = p.alloc().unwrap();
    full.append(1).unwrap();
    assert_eq!(full.attach(&payload).unwrap_err().pkt_len(), 1);
    drop((i3, back));
    assert_eq!(payload.refcnt(), 3);
    // References reserved at once, handed out as handles, the rest given
    // back; the buffer returns to its pool with its last reference.
    let mut shares = payload.reserve(10).unwrap();
    assert_eq!(payload.refcnt(), 13);
    let h = shares.take().unwrap();
    assert_eq!((h.data(), shares.left()), (&b"12345"[..], 9));
    assert!(i2.reserve(1).is_none(), "not for an indirect mbuf");
    let mut head = p.alloc().unwrap();
    head.append(1).unwrap();
    let segs = head.chain(p.alloc().unwrap()).unwrap();
    assert!(segs.reserve(1).is_none(), "not for a chain");
    drop(segs);
    drop(h);
    assert_eq!(payload.refcnt(), 12, "a taken handle frees its reference");
    drop(shares);
    assert_eq!(payload.refcnt(), 3);
    let lone = p.alloc().unwrap();
    let mut s2 = lone.reserve(2).unwrap();
    let kept = s2.take().unwrap();
    drop(lone);
    drop(s2);
    assert_eq!(kept.refcnt(), 1);
    let before = p.in_use();
    drop(kept);
    assert_eq!(
        p.in_use(),
        before - 1,
        "freed to the pool with the last reference"
    );
    drop(payload);
    assert_eq!(i2.data(), b"12345", "the payload lives while shared");
    drop(chain);
    drop(i2);
    assert_eq!(p.in_use(), 0);
    assert_eq!(ind.in_use(), 0);
    let mut batch: [Option<Mbuf>; 8] = Default::default();
    assert!(p.alloc_bulk(&mut batch));
    assert_eq!(p.in_use(), 8);
    let mut v: Vec<Mbuf> = batch.iter_mut().map(|s| s.take().unwrap()).collect();
    phub_ffi::mbuf::free_bulk(&mut v);
    assert!(v.is_empty());
    assert_eq!(p.in_use(), 0);
}

#[test]
fn header_segments_share_one_payload_segment() {
    let Some(e) = eal() else { return };
    let p = pool(e, 64, 2048 + phub_ffi::PKTMBUF_HEADROOM);
    let mut payload = p.alloc().unwrap();
    assert!(payload.extend_from_slice(b"payload"));
    let mut shares = payload.into_shares(3).unwrap();
    assert_eq!(shares.left(), 3);
    let mut frames = Vec::new();
    for name in [&b"one:"[..], b"two:", b"three:"] {
        let mut h = p.alloc().unwrap();
        assert!(h.extend_from_slice(name));
        frames.push(h.chain_shared(shares.take().unwrap()).unwrap());
    }
    drop(shares);
    assert_eq!(frames[0].to_vec(), b"one:payload");
    assert_eq!((frames[2].nb_segs(), frames[2].pkt_len()), (2, 13));
    assert_eq!(frames[1].to_vec(), b"two:payload");
    assert_eq!(p.in_use(), 4, "three headers, one payload");
    // Not in front of anything when this segment is shared or a chain.
    let mut h = p.alloc().unwrap();
    h.append(1).unwrap();
    let other = h.reserve(1).unwrap();
    let (h, t) = h.chain_shared(p.alloc().unwrap()).unwrap_err();
    assert_eq!((h.nb_segs(), t.nb_segs()), (1, 1));
    drop((h, t, other));
    let (chain, t) = frames
        .pop()
        .unwrap()
        .chain_shared(p.alloc().unwrap())
        .unwrap_err();
    assert_eq!(chain.nb_segs(), 2);
    drop(t);
    // One reference as shares: no count taken; none: freed.
    let one = p.alloc().unwrap().into_shares(1).unwrap();
    assert_eq!((one.left(), p.in_use()), (1, 5));
    drop(one);
    let none = p.alloc().unwrap().into_shares(0).unwrap();
    assert_eq!((none.left(), p.in_use()), (0, 4));
    let mut two = p.alloc().unwrap();
    two.append(1).unwrap();
    let two = two.chain(p.alloc().unwrap()).unwrap();
    assert_eq!(two.into_shares(2).unwrap_err().nb_segs(), 2, "not a chain");
    assert_eq!(p.in_use(), 4);
    // Freed one by one and in bulk: the payload goes back with the last.
    drop(chain);
    assert_eq!(p.in_use(), 3);
    phub_ffi::mbuf::free_bulk(&mut frames);
    assert_eq!(p.in_use(), 0);
}

#[test]
fn rings_pass_mbufs_and_free_leftovers() {
    let Some(e) = eal() else { return };
    let p = pool(e, 64, 256);
    let r = Ring::create(e, "t", 16, None).unwrap();
    assert!(Ring::create(e, "t", 15, None).is_err());
    let mut v: Vec<Mbuf> = (0..20).map(|_| p.alloc().unwrap()).collect();
    assert_eq!(r.enqueue_burst(&mut v), 15, "a ring of 16 holds 15");
    assert_eq!(v.len(), 5);
    let extra = v.pop().unwrap();
    assert!(r.enqueue(extra).is_err());
    let mut out: [Option<Mbuf>; 4] = Default::default();
    assert_eq!(r.dequeue_burst(&mut out), 4);
    assert!(out.iter().all(Option::is_some));
    drop(out);
    drop(v);
    assert_eq!(p.in_use(), 11);
    drop(r);
    assert_eq!(p.in_use(), 0, "a dropped ring frees what it held");
}

#[test]
fn named_rings_are_found_by_name_and_a_found_handle_frees_nothing() {
    let Some(e) = eal() else { return };
    let p = pool(e, 16, 256);
    let r = Ring::create_named(e, "phub-test-named", 16, None).unwrap();
    let e2 = Ring::create_named(e, "phub-test-named", 16, None).unwrap_err();
    assert!(e2.to_string().contains("phub-test-named"), "{e2}");
    let found = Ring::lookup(e, "phub-test-named").unwrap();
    found.enqueue(p.alloc().unwrap()).unwrap();
    found.enqueue(p.alloc().unwrap()).unwrap();
    assert_eq!(r.len(), 2, "one ring behind both handles");
    drop(found);
    assert_eq!(
        p.in_use(),
        2,
        "dropping a found handle leaves the ring and its mbufs alone"
    );
    let mut out: [Option<Mbuf>; 1] = Default::default();
    assert_eq!(r.dequeue_burst(&mut out), 1);
    drop(out);
    drop(r);
    assert_eq!(p.in_use(), 0, "the maker's last handle frees what the ring held");
    let missing = Ring::lookup(e, "phub-test-missing").unwrap_err();
    assert!(
        missing.to_string().contains("phub-test-missing") && missing.to_string().contains("--file-prefix"),
        "{missing}"
    );
}

#[test]
fn a_port_of_rings_moves_frames_on_chosen_queues() {
    let Some(e) = eal() else { return };
    let rx: Vec<Ring> = (0..2).map(|_| Ring::create(e, "rx", 64, None).unwrap()).collect();
    let tx: Vec<Ring> = (0..2).map(|_| Ring::create(e, "tx", 64, None).unwrap()).collect();
    let id = e.port_from_rings("net_ring_fft", &rx, &tx, 0).unwrap();
    let p = pool(e, 512, 2048 + phub_ffi::PKTMBUF_HEADROOM);
    let (port, mut rxq, mut txq) = PortBuilder::new(e, id)
        .queues(2)
        .descriptors(128, 128)
        .rx_pool(p.clone())
        .build()
        .unwrap();
    assert_eq!((rxq.len(), txq.len()), (2, 2));
    assert_eq!(port.info().driver, "net_ring");
    // Inject into RX queue 1 only.
    let mut m = p.alloc().unwrap();
    assert!(m.extend_from_slice(b"to queue one"));
    rx[1].enqueue(m).unwrap();
    let mut out: [Option<Mbuf>; 8] = Default::default();
    assert_eq!(rxq[0].rx_burst(&mut out), 0);
    assert_eq!(rxq[1].rx_burst(&mut out), 1);
    assert_eq!(out[0].as_ref().unwrap().data(), b"to queue one");
    // Send it back out on TX queue 0.
    let mut v = vec![out[0].take().unwrap()];
    assert_eq!(txq[0].tx_burst(&mut v), 1);
    assert!(v.is_empty());
    let mut got: [Option<Mbuf>; 8] = Default::default();
    assert_eq!(tx[0].dequeue_burst(&mut got), 1);
    assert_eq!(got[0].as_ref().unwrap().data(), b"to queue one");
    assert!(tx[1].is_empty());
    let s = port.stats().unwrap();
    assert_eq!((s.ipackets, s.opackets), (1, 1));
    assert!(port.steer_udp_dst(7900, 1).is_err(), "net_ring has no rte_flow");
    drop(got);
    drop((port, rxq, txq));
}

#[test]
fn null_port_and_builder_errors() {
    let Some(e) = eal() else { return };
    let id = e.port_by_name("net_null0").expect("the --vdev port");
    let info = phub_ffi::port::info(e, id).unwrap();
    assert_eq!(info.driver, "net_null");
    let p = pool(e, 2048, 2048 + phub_ffi::PKTMBUF_HEADROOM);
    let err = PortBuilder::new(e, id)
        .queues(2000)
        .rx_pool(p.clone())
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("queue pairs asked"), "{err}");
    let err = PortBuilder::new(e, 999).rx_pool(p.clone()).build().unwrap_err();
    assert!(err.to_string().contains("no such port"), "{err}");
    let (port, mut rxq, _txq) = PortBuilder::new(e, id).rx_pool(p.clone()).build().unwrap();
    let mut out: [Option<Mbuf>; 32] = Default::default();
    assert!(rxq[0].rx_burst(&mut out) > 0, "net_null always has packets");
    drop(out);
    drop(rxq);
    let _ = port.stats().unwrap();
}

#[test]
fn launch_runs_on_a_worker_lcore_and_returns_its_value() {
    let Some(e) = eal() else { return };
    let w = e.worker_lcores()[0];
    let l = lcore::launch(e, w, move || lcore::current().map_or(-1, |c| c as i32 * 10 + 7)).unwrap();
    assert_eq!(l.wait(), w as i32 * 10 + 7);
    let err = lcore::launch(e, e.main_lcore(), || 0).unwrap_err();
    assert!(err.to_string().contains("not a worker lcore"), "{err}");
    let l = lcore::launch(e, w, || panic!("boom")).unwrap();
    assert_eq!(l.wait(), -1, "a panic becomes -1, not an abort");
}

#[test]
fn heap_slices_are_zeroed_aligned_and_refused_cleanly_when_too_large() {
    let Some(e) = eal() else { return };
    let before = phub_ffi::malloc::heap_stats(e, 0).unwrap();
    assert!(before.total_bytes > 0 && before.free_bytes <= before.total_bytes);
    let mut s = phub_ffi::HeapSlice::<f32>::zeroed(e, 1000, 64, Some(0)).unwrap();
    assert_eq!((s.len(), s.bytes(), s.socket()), (1000, 4000, Some(0)));
    assert_eq!(s.as_ptr() as usize % 64, 0, "64-byte aligned");
    assert!(s.iter().all(|&x| x == 0.0), "zeroed");
    s.as_mut_slice()[999] = 2.5;
    assert_eq!(s[999], 2.5);
    let any = phub_ffi::HeapSlice::<u16>::zeroed(e, 3, 4096, None).unwrap();
    assert_eq!(any.as_ptr() as usize % 4096, 0);
    let empty = phub_ffi::HeapSlice::<u8>::zeroed(e, 0, 64, Some(0)).unwrap();
    assert!(empty.is_empty());
    drop((s, any, empty));
    // More than the whole --no-huge heap (-m 256): refused, naming the
    // bytes, the socket and what is free.
    let big = 512usize << 20;
    let err = phub_ffi::HeapSlice::<u8>::zeroed(e, big, 64, Some(0)).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, phub_ffi::Error::NoMemory { bytes, socket: Some(0), free: Some(_), .. } if bytes == big),
        "{err:?}"
    );
    assert!(
        text.contains("socket 0") && text.contains(&big.to_string()),
        "{text}"
    );
    assert!(
        phub_ffi::HeapSlice::<u8>::zeroed(e, 8, 3, None).is_err(),
        "alignment 3 refused"
    );
}
