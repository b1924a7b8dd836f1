use std::net::Ipv4Addr;

use super::*;
use crate::pipeline::schedule::{stage_actions, Action, PipelineSchedule};
use crate::store::MemoryStore;

const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const LONG: Duration = Duration::from_secs(120);

/// Runs `body(rank, links)` on every rank of `layout` in its own thread, with `plan_of`'s
/// plan, and returns each rank's result.
fn on_every_rank<T: Send + 'static>(
    layout: PipelineLayout,
    timeout: Duration,
    plan_of: fn(usize) -> &'static str,
    body: impl Fn(usize, Result<StageLinks, LinkError>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let body = Arc::new(body);
    let threads: Vec<_> = (0..layout.world_size())
        .map(|rank| {
            let (store, body) = (Arc::clone(&store), Arc::clone(&body));
            std::thread::spawn(move || {
                let links = StageLinks::connect(
                    store,
                    "pipeline",
                    &layout,
                    rank,
                    plan_of(rank),
                    &TcpGroupOptions {
                        timeout,
                        advertise_ip: Some(LOCAL),
                        ..Default::default()
                    },
                );
                body(rank, links)
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("a rank's thread panicked"))
        .collect()
}

fn same_plan(_: usize) -> &'static str {
    "stages=3 schedule=1f1b micro_batches=6"
}

/// Each stage adds 1 going forward; the last stage's gradient is its output; each stage
/// passes the gradient back times 2. 2 Mi values per message: far past the socket buffers,
/// so the steady state's crossing sends would deadlock if sends waited for the receiver.
#[test]
fn one_f_one_b_traffic_crosses_without_deadlock_and_arrives_intact() {
    let layout = PipelineLayout::new(6, 3).unwrap();
    let micro = 6;
    let results = on_every_rank(layout, LONG, same_plan, move |rank, links| {
        let mut links = links.unwrap();
        let stage = layout.position(rank).stage;
        let n = 1 << 21;
        let mut outputs = vec![Vec::new(); micro];
        let mut first_grads = Vec::new();
        for action in stage_actions(PipelineSchedule::OneForwardOneBackward, 3, stage, micro) {
            match action {
                Action::Forward(i) => {
                    let input = if stage == 0 {
                        vec![(rank * 100 + i) as f32; n]
                    } else {
                        let (shape, values) = links.recv_activation(i).unwrap();
                        assert_eq!(shape, vec![n / 2, 2]);
                        values
                    };
                    let output: Vec<f32> = input.iter().map(|v| v + 1.0).collect();
                    if stage < 2 {
                        links.send_activation(i, &[n / 2, 2], &output).unwrap();
                    }
                    outputs[i] = output;
                }
                Action::Backward(i) => {
                    let grad = if stage == 2 {
                        std::mem::take(&mut outputs[i])
                    } else {
                        links.recv_gradient(i).unwrap().1
                    };
                    let back: Vec<f32> = grad.iter().map(|g| g * 2.0).collect();
                    if stage > 0 {
                        links.send_gradient(i, &[n], &back).unwrap();
                    } else {
                        first_grads.push((back[0], back[n - 1]));
                    }
                }
            }
        }
        links.flush().unwrap();
        first_grads
    });
    for (rank, grads) in results.iter().enumerate() {
        if layout.position(rank).stage != 0 {
            assert!(grads.is_empty());
            continue;
        }
        // x + 3 after three stages, times 2 on each stage on the way back.
        let expected: Vec<(f32, f32)> = (0..micro)
            .map(|i| {
                let v = ((rank * 100 + i) as f32 + 3.0) * 8.0;
                (v, v)
            })
            .collect();
        assert_eq!(grads, &expected, "rank {rank}");
    }
}

#[test]
fn a_neighbour_with_another_plan_is_refused_naming_both_ranks() {
    let layout = PipelineLayout::new(2, 2).unwrap();
    let plan_of = |rank| {
        if rank == 0 {
            "stages=2 m=4"
        } else {
            "stages=2 m=8"
        }
    };
    let errors = on_every_rank(layout, LONG, plan_of, |_, links| {
        links.err().map(|e| e.to_string())
    });
    let rank_0 = errors[0].as_deref().unwrap_or_default();
    assert!(
        rank_0.contains("rank 0") && rank_0.contains("rank 1") && rank_0.contains("m=8"),
        "{rank_0}"
    );
    assert!(errors[1]
        .as_deref()
        .unwrap_or_default()
        .contains("\"stages=2 m=4\""));
}

#[test]
fn strangers_on_a_stage_port_are_refused_and_the_links_form() {
    use crate::group::wire::{encode_hello, RingHello};
    let layout = PipelineLayout::new(3, 3).unwrap();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let options = TcpGroupOptions {
        timeout: LONG,
        advertise_ip: Some(LOCAL),
        token: "job-token".into(),
        ..Default::default()
    };
    let spawn_rank = |rank: usize| {
        let (store, options) = (Arc::clone(&store), options.clone());
        std::thread::spawn(move || {
            let mut links =
                StageLinks::connect(store, "pipeline", &layout, rank, "plan", &options).unwrap();
            match rank {
                1 => {
                    links.send_activation(0, &[2], &[1.0, 2.0]).unwrap();
                    links.flush().unwrap();
                    None
                }
                2 => Some(links.recv_activation(0).unwrap()),
                _ => None,
            }
        })
    };
    // Stage 2 listens for stage 1; before stage 1 starts, stage 2's backlog gets garbage
    // and a hello with the wrong token.
    let (stage0, stage2) = (spawn_rank(0), spawn_rank(2));
    let addr = String::from_utf8(store.get("pipeline/addr/2", LONG).unwrap()).unwrap();
    let mut garbage = TcpStream::connect(&addr).unwrap();
    garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let mut impostor = TcpStream::connect(&addr).unwrap();
    impostor
        .write_all(&encode_hello(&RingHello {
            rank: 1,
            world_size: 3,
            token: "guess".into(),
        }))
        .unwrap();
    let stage1 = spawn_rank(1);
    assert!(stage0.join().unwrap().is_none());
    assert!(stage1.join().unwrap().is_none());
    assert_eq!(stage2.join().unwrap(), Some((vec![2], vec![1.0, 2.0])));
}

#[test]
fn a_neighbour_that_exits_is_named_at_once() {
    let layout = PipelineLayout::new(2, 2).unwrap();
    let errors = on_every_rank(layout, LONG, same_plan, |rank, links| {
        let mut links = links.unwrap();
        if rank == 1 {
            drop(links); // as if the process exited
            return None;
        }
        let started = Instant::now();
        let error = links.recv_gradient(0).unwrap_err();
        assert!(
            started.elapsed() < LONG / 2,
            "waited for the timeout instead"
        );
        Some(error.to_string())
    });
    let error = errors[0].as_deref().unwrap_or_default();
    assert!(
        error.contains("rank 1") && error.contains("closed the connection"),
        "{error}"
    );
}

#[test]
fn a_silent_neighbour_times_out_naming_it() {
    let layout = PipelineLayout::new(2, 2).unwrap();
    let (done, wait) = mpsc::channel::<()>();
    let wait = Mutex::new(wait);
    let errors = on_every_rank(
        layout,
        Duration::from_secs(1),
        same_plan,
        move |rank, links| {
            let mut links = links.unwrap();
            if rank == 1 {
                // Alive and connected, but sends nothing until rank 0 has given up.
                let _ = wait.lock().unwrap().recv();
                return None;
            }
            let error = links.recv_gradient(0).unwrap_err();
            let _ = done.send(());
            Some(error.to_string())
        },
    );
    let error = errors[0].as_deref().unwrap_or_default();
    assert!(error.contains("waited 1s for rank 1"), "{error}");
}

#[test]
fn a_frame_out_of_order_names_what_was_expected() {
    let layout = PipelineLayout::new(2, 2).unwrap();
    let errors = on_every_rank(layout, LONG, same_plan, |rank, links| {
        let mut links = links.unwrap();
        if rank == 0 {
            links.send_activation(1, &[1], &[0.5]).unwrap();
            links.flush().unwrap();
            return None;
        }
        Some(links.recv_activation(0).unwrap_err().to_string())
    });
    let error = errors[1].as_deref().unwrap_or_default();
    assert!(
        error.contains("Activation of micro-batch 1")
            && error.contains("expected the Activation of micro-batch 0"),
        "{error}"
    );
}
