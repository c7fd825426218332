use super::*;
use crate::msg::ChipReport;

fn chip(host: u16, n: u64, state: ChipState, load: usize) -> (Addr, ChipView) {
    let addr = Addr::new(HostId(host), n);
    let report = ChipReport {
        chip: addr,
        id: format!("h{host}-{n}"),
        host_name: format!("h{host}"),
        role: "both".into(),
        state,
        kv_blocks_used: 0,
        kv_blocks_total: 8,
        running: 0,
        waiting: 0,
        steps: 0,
        max_step_seqs: 0,
        restarts: 0,
        error: None,
    };
    (addr, ChipView { report, load_tokens: load })
}

#[test]
fn pick_is_least_loaded_healthy_chip() {
    use ChipState::*;
    let a = |h, n| Addr::new(HostId(h), n);
    // (chips, hosts down, exclude, expected)
    type Case = (Vec<(Addr, ChipView)>, Vec<u16>, Vec<Addr>, Option<Addr>);
    let table: Vec<Case> = vec![
        (vec![chip(0, 16, Up, 100), chip(1, 16, Up, 50)], vec![], vec![], Some(a(1, 16))),
        (vec![chip(0, 16, Up, 10), chip(1, 16, Up, 10)], vec![], vec![], Some(a(0, 16))), // tie: lowest address
        (vec![chip(0, 16, Up, 100), chip(1, 16, Starting, 0)], vec![], vec![], Some(a(0, 16))),
        (vec![chip(0, 16, Down, 0), chip(1, 16, Failed, 0)], vec![], vec![], None),
        (vec![chip(0, 16, Up, 0), chip(1, 16, Up, 500)], vec![0], vec![], Some(a(1, 16))), // host down
        (vec![chip(0, 16, Up, 0), chip(1, 16, Up, 500)], vec![], vec![a(0, 16)], Some(a(1, 16))), // excluded
        (vec![chip(0, 16, Up, 0)], vec![], vec![a(0, 16)], Some(a(0, 16))), // excluded, but the only one
        (vec![], vec![], vec![], None),
    ];
    for (i, (chips, down, exclude, want)) in table.into_iter().enumerate() {
        let chips: BTreeMap<Addr, ChipView> = chips.into_iter().collect();
        let down: BTreeSet<HostId> = down.into_iter().map(HostId).collect();
        assert_eq!(pick(&chips, &down, &exclude), want, "case {i}");
    }
}
