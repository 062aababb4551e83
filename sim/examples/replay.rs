//! Prints the case of a seed and runs it: `cargo run -p phub-sim --example
//! replay -- SEED` (with `PHUB_SIM_TRACE=1`, every datagram delivered is
//! printed with its virtual time, sender, receiver and header).

fn main() {
    let Some(seed) = std::env::args().nth(1).and_then(|s| s.parse::<u64>().ok()) else {
        eprintln!("usage: replay SEED (a whole number: the seed random_jobs drew the case from)");
        std::process::exit(2);
    };
    let case = phub_sim::Case::draw(seed);
    println!("{case:#?}");
    let outcome = phub_sim::run(&case);
    println!("{outcome:#?}");
}
