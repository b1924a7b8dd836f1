//! The user's own data for the built-in apps, end to end: a CSV file (classification with named
//! labels; regression with two targets), an SQLite table in burn-dataset's `SqliteDataset`
//! format and an image folder each train with 2 ranks from a config; each rank reads
//! (`Dataset::get`) only the items of its shard; bad input stops with exit code 2 and a message
//! naming the file and the place, never a panic. Every file is generated here.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use image::{GrayImage, Luma, Rgb, RgbImage};
use rusqlite::Connection;

use crate::common::*;

/// The trainer's read log hook (`trainer::sources::counting`).
const COUNT_READS: &str = "TRAINER_COUNT_DATA_READS";

/// Samples in each generated table: 0.2 of them for validation leaves 128 for training, 64 per
/// rank, 8 full batches of 8: no padding, no partial batch.
const ROWS: usize = 160;
const TRAIN_ROWS: usize = 128;

fn config_body(model: &str, data: &str, epochs: usize) -> String {
    format!(
        r#"
[model]
{model}

[data]
{data}

[optimizer]
name = "adam"
learning_rate = 0.01

[training]
epochs = {epochs}
batch_size = 8
seed = 3
log_every = 4

[checkpoint]
dir = "{{ckpt}}"
every_epochs = 0

[output]
dir = "{{out}}"
log_samples = true
"#
    )
}

/// Two features in [0, 1) for row `i`, spread over the square.
fn point(i: usize) -> (f32, f32) {
    ((i * 37 % 100) as f32 / 100.0, (i * 61 % 100) as f32 / 100.0)
}

/// Trains `config` with 2 ranks, each logging its reads to `<dir>/<name>-reads/`; expects
/// success and a final validation.
fn train_counting_reads(dir: &Path, name: &str, config: &Path) -> Output {
    let reads = dir.join(format!("{name}-reads"));
    std::fs::create_dir_all(&reads).unwrap();
    let out = run(trainer()
        .env(COUNT_READS, &reads)
        .arg("--config")
        .arg(config)
        .args(["--nproc-per-node", "2"]));
    assert_eq!(out.code, Some(0), "{name}:\n{}", out.all());
    assert!(out.stdout.contains("final validation"), "{}", out.all());
    assert!(!out.all().contains("panicked"), "{}", out.all());
    out
}

/// The indices, one per line, of a file.
fn indices(path: &Path) -> Vec<usize> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| l.parse().unwrap())
        .collect()
}

/// After one epoch of the run `name` (`train_counting_reads`): each rank read exactly the
/// training items its sampler gave it (`samples-rank<R>.txt`), each once, and the two ranks'
/// items are disjoint and together the whole training set: no rank read the other's shard, or
/// the whole set. Validation items were read by one rank each.
fn assert_each_rank_read_only_its_shard(dir: &Path, name: &str, train: usize, valid: usize) {
    let reads = dir.join(format!("{name}-reads"));
    let out = dir.join(format!("{name}-out"));
    let mut everyone = Vec::new();
    for rank in 0..2 {
        let mut read = indices(&reads.join(format!("reads-train-rank{rank}.txt")));
        let mut sampled: Vec<usize> =
            std::fs::read_to_string(out.join(format!("samples-rank{rank}.txt")))
                .unwrap()
                .lines()
                .map(|l| l.split(' ').nth(1).unwrap().parse().unwrap())
                .collect();
        read.sort_unstable();
        sampled.sort_unstable();
        assert_eq!(
            read.len(),
            train / 2,
            "rank {rank} read its half of the training set"
        );
        assert_eq!(
            read, sampled,
            "rank {rank} read exactly the items of its shard"
        );
        everyone.extend(read);
    }
    everyone.sort_unstable();
    assert_eq!(
        everyone,
        (0..train).collect::<Vec<_>>(),
        "the two shards are disjoint and cover the training set"
    );
    let valid_reads: Vec<BTreeSet<usize>> = (0..2)
        .map(|rank| {
            indices(&reads.join(format!("reads-valid-rank{rank}.txt")))
                .into_iter()
                .collect()
        })
        .collect();
    assert!(
        valid_reads[0].is_disjoint(&valid_reads[1]),
        "a validation item is read by one rank: {valid_reads:?}"
    );
    let all: BTreeSet<usize> = valid_reads.iter().flatten().copied().collect();
    assert_eq!(all, (0..valid).collect(), "every validation item is read");
}

/// The label of row `i` of the labelled CSV: "low", "mid" or "high" by the sum of its features.
fn label_of(i: usize) -> &'static str {
    let (x1, x2) = point(i);
    match x1 + x2 {
        s if s < 0.8 => "low",
        s if s < 1.2 => "mid",
        _ => "high",
    }
}

/// A CSV file with an id, two features, a quoted text column with commas and a line break (so
/// row `i` starts on line `2 + 2i`), and a label ([`label_of`]).
fn write_labelled_csv(path: &Path) {
    let mut text = String::from("id,x1,note,x2,label\n");
    for i in 0..ROWS {
        let (x1, x2) = point(i);
        let label = label_of(i);
        text += &format!("{i},{x1},\"row {i}, \"\"quoted\"\"\nover two lines\",{x2},{label}\n");
    }
    std::fs::write(path, text).unwrap();
}

#[test]
fn csv_classification_trains_with_two_ranks_each_reading_only_its_shard() {
    let dir = scratch("data-csv-classes");
    let csv = dir.join("points.csv");
    write_labelled_csv(&csv);
    let data = format!(
        "source = \"csv\"\npath = \"{}\"\nfeatures = [\"x1\", \"x2\"]\ntarget = \"label\"\nlabels = [\"low\", \"mid\", \"high\"]",
        csv.display()
    );
    let body = config_body("name = \"mlp\"\nhidden = [16]", &data, 1);
    train_counting_reads(&dir, "run", &write_config(&dir, "run", &body));
    assert_each_rank_read_only_its_shard(&dir, "run", TRAIN_ROWS, ROWS - TRAIN_ROWS);
}

#[test]
fn csv_regression_with_two_targets_trains_with_two_ranks() {
    let dir = scratch("data-csv-regression");
    let csv = dir.join("values.csv");
    let mut text = String::from("x1,x2,y,z\n");
    for i in 0..ROWS {
        let (x1, x2) = point(i);
        text += &format!(" {x1} ,{x2},{},{}\n", 2.0 * x1 - x2 + 0.5, x1 * x2);
    }
    std::fs::write(&csv, text).unwrap();
    let data = format!(
        "source = \"csv\"\npath = \"{}\"\nfeatures = [\"x1\", \"x2\"]\ntarget = [\"y\", \"z\"]",
        csv.display()
    );
    let body = config_body("name = \"regression\"\nhidden = [16]", &data, 3);
    let out = train_counting_reads(&dir, "run", &write_config(&dir, "run", &body));
    // Predicting 0 scores about 0.76 on these targets; the run reaches about 0.15.
    let loss = final_metric(&out, "Loss");
    assert!(loss < 0.4, "validation MSE {loss}:\n{}", out.all());
}

/// An SQLite database as Burn's Hugging Face importer lays it out: a table per split with a
/// `row_id` from 1, four number columns, an integer class, and a blob column not read.
fn write_database(path: &Path) {
    let db = Connection::open(path).unwrap();
    for table in ["train", "test"] {
        db.execute_batch(&format!(
            "CREATE TABLE {table} (row_id INTEGER PRIMARY KEY, f0 REAL, f1 REAL, f2 REAL, f3 INTEGER, label INTEGER, image BLOB);"
        ))
        .unwrap();
    }
    let mut insert = db
        .prepare("INSERT INTO train VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)")
        .unwrap();
    for i in 0..ROWS {
        let (x1, x2) = point(i);
        let label = i64::from(x1 > x2);
        insert
            .execute(rusqlite::params![
                i as i64 + 1,
                f64::from(x1),
                f64::from(x2),
                f64::from(x1 - x2),
                (i % 3) as i64,
                label,
                vec![i as u8; 4],
            ])
            .unwrap();
    }
}

#[test]
fn sqlite_table_trains_with_two_ranks_each_reading_only_its_shard() {
    let dir = scratch("data-sqlite");
    let db = dir.join("points.db");
    write_database(&db);
    let data = format!(
        "source = \"sqlite\"\npath = \"{}\"\ntable = \"train\"\nfeatures = [\"f0\", \"f1\", \"f2\", \"f3\"]\ntarget = \"label\"\nclasses = 2",
        db.display()
    );
    let body = config_body("name = \"mlp\"\nhidden = [16]", &data, 1);
    train_counting_reads(&dir, "run", &write_config(&dir, "run", &body));
    assert_each_rank_read_only_its_shard(&dir, "run", TRAIN_ROWS, ROWS - TRAIN_ROWS);
}

/// `root/dark/` and `root/light/`: 20 images each, PNG, JPEG and BMP, grey and RGB, of sizes
/// other than the configured 8x8.
fn write_image_folder(root: &Path) {
    for (class, base) in [("dark", 30u8), ("light", 200u8)] {
        let folder = root.join(class);
        std::fs::create_dir_all(&folder).unwrap();
        for i in 0..20u8 {
            let shade = |x: u32, y: u32| base + ((x + y) as u8 + i) % 24;
            match i % 4 {
                0 => RgbImage::from_fn(10, 10, |x, y| Rgb([shade(x, y), shade(y, x), base]))
                    .save(folder.join(format!("{i:02}.jpg")))
                    .unwrap(),
                1 => GrayImage::from_fn(8, 8, |x, y| Luma([shade(x, y)]))
                    .save(folder.join(format!("{i:02}.bmp")))
                    .unwrap(),
                _ => GrayImage::from_fn(6, 7, |x, y| Luma([shade(x, y)]))
                    .save(folder.join(format!("{i:02}.PNG")))
                    .unwrap(),
            }
        }
    }
}

fn image_data(root: &Path) -> String {
    format!(
        "source = \"image-folder\"\npath = \"{}\"\nimage_size = [8, 8]\nclasses = 2",
        root.display()
    )
}

const SMALL_CNN: &str = "name = \"cnn\"\nchannels = [4, 4]\nhidden = 8";

#[test]
fn image_folder_trains_a_cnn_with_two_ranks_each_reading_only_its_shard() {
    let dir = scratch("data-images");
    let root = dir.join("images");
    write_image_folder(&root);
    let body = config_body(SMALL_CNN, &image_data(&root), 1);
    train_counting_reads(&dir, "run", &write_config(&dir, "run", &body));
    // 40 images: 8 for validation, 32 for training (16 per rank, 2 batches of 8).
    assert_each_rank_read_only_its_shard(&dir, "run", 32, 8);
}

/// Runs `config` with `nproc` ranks; expects exit code 2, every one of `needles` on stderr and
/// no panic.
fn assert_refused(name: &str, config: &Path, nproc: usize, needles: &[&str]) {
    let out = run(trainer()
        .arg("--config")
        .arg(config)
        .args(["--nproc-per-node", &nproc.to_string()]));
    assert_eq!(out.code, Some(2), "{name}:\n{}", out.all());
    for needle in needles {
        assert!(
            out.stderr.contains(needle),
            "{name}: the message should say {needle:?}:\n{}",
            out.all()
        );
    }
    assert!(!out.all().contains("panicked"), "{name}:\n{}", out.all());
}

#[test]
fn bad_data_is_exit_2_naming_the_file_and_the_place() {
    let dir = scratch("data-bad");
    let mlp = "name = \"mlp\"\nhidden = [8]";
    let csv = dir.join("points.csv");
    write_labelled_csv(&csv);
    let csv_data = |features: &str, extra: &str| {
        format!(
            "source = \"csv\"\npath = \"{}\"\nfeatures = {features}\ntarget = \"label\"\n{extra}",
            csv.display()
        )
    };
    let labels = "labels = [\"low\", \"mid\", \"high\"]";

    let mut cells = String::from("x1,x2,label\n");
    for i in 0..10 {
        cells += &format!("{i},{},{}\n", if i == 3 { "abc" } else { "0.5" }, i % 2);
    }
    let bad_cell = dir.join("bad-cell.csv");
    std::fs::write(&bad_cell, cells).unwrap();

    let db = dir.join("points.db");
    write_database(&db);
    let bad_db = dir.join("bad-cell.db");
    write_database(&bad_db);
    Connection::open(&bad_db)
        .unwrap()
        .execute("UPDATE train SET f2 = 'n/a' WHERE row_id = 7", [])
        .unwrap();
    let sqlite_data = |path: &Path, table: &str| {
        format!(
            "source = \"sqlite\"\npath = \"{}\"\ntable = \"{table}\"\nfeatures = [\"f0\", \"f1\", \"f2\"]\ntarget = \"label\"\nclasses = 2",
            path.display()
        )
    };

    let no_classes = dir.join("no-classes");
    std::fs::create_dir_all(no_classes.join(".cache")).unwrap();
    std::fs::write(no_classes.join("stray.png"), "x").unwrap();
    let empty_class = dir.join("empty-class");
    write_image_folder(&empty_class);
    std::fs::create_dir_all(empty_class.join("misty")).unwrap();
    std::fs::write(empty_class.join("misty/notes.txt"), "no images").unwrap();

    let bad_cell_needle = format!(
        "{} line 5, column 'x2': expected a number, found \"abc\"",
        bad_cell.display()
    );
    let cases: Vec<(&str, String, String)> = vec![
        (
            "missing-column",
            csv_data("[\"x1\", \"nope\"]", labels),
            format!(
                "{}: no column 'nope' in the header (its columns: id, x1, note, x2, label)",
                csv.display()
            ),
        ),
        (
            "non-numeric-cell",
            format!(
                "source = \"csv\"\npath = \"{}\"\nfeatures = [\"x1\", \"x2\"]\ntarget = \"label\"\nclasses = 2",
                bad_cell.display()
            ),
            bad_cell_needle,
        ),
        (
            "unknown-label",
            csv_data("[\"x1\", \"x2\"]", "labels = [\"low\", \"high\"]"),
            format!(
                "{} line {}, column 'label': expected one of the labels [\"low\", \"high\"] (data.labels), found \"mid\"",
                csv.display(),
                2 + 2 * (0..ROWS).position(|i| label_of(i) == "mid").unwrap()
            ),
        ),
        (
            "features-not-columns",
            csv_data("2", labels),
            "data.features: name the feature columns".into(),
        ),
        (
            "wrong-table",
            sqlite_data(&db, "validation"),
            format!(
                "{}: no table 'validation' (its tables: test, train); set data.table",
                db.display()
            ),
        ),
        (
            "sqlite-non-numeric-cell",
            sqlite_data(&bad_db, "train"),
            format!(
                "{} table 'train' row_id 7, column 'f2': expected a number, found \"n/a\"",
                bad_db.display()
            ),
        ),
        (
            "empty-table",
            sqlite_data(&db, "test"),
            format!("{} table 'test' has no rows", db.display()),
        ),
        (
            "no-class-folders",
            image_data(&no_classes),
            format!("{} has no class sub-folders", no_classes.display()),
        ),
        (
            "class-folder-without-images",
            image_data(&empty_class).replace("classes = 2", "classes = 3"),
            format!(
                "{} (class 2) holds no images",
                empty_class.join("misty").display()
            ),
        ),
        (
            "missing-folder",
            image_data(&dir.join("nowhere")),
            format!("cannot open data file '{}'", dir.join("nowhere").display()),
        ),
    ];
    for (name, data, needle) in cases {
        let model = if name.contains("folder") {
            SMALL_CNN
        } else {
            mlp
        };
        let config = write_config(&dir, name, &config_body(model, &data, 1));
        assert_refused(name, &config, 2, &[&needle]);
        assert!(
            !dir.join(format!("{name}-ckpt")).exists(),
            "{name}: nothing written"
        );
    }
}

/// An image that cannot be decoded is found when it is read (opening lists names only): the
/// run stops with exit code 2 naming the file.
#[test]
fn a_corrupt_image_is_exit_2_naming_the_file() {
    let dir = scratch("data-corrupt-image");
    let root = dir.join("images");
    write_image_folder(&root);
    let broken: PathBuf = root.join("light/07.png");
    std::fs::write(&broken, b"\x89PNG\r\n\x1a\nnot an image after all").unwrap();
    let data = image_data(&root) + "\nvalidation_fraction = 0.0";
    let config = write_config(&dir, "corrupt", &config_body(SMALL_CNN, &data, 1));
    let needle = format!("cannot decode image '{}'", broken.display());
    assert_refused("corrupt-image", &config, 1, &[&needle]);
    assert_refused("corrupt-image", &config, 2, &[&needle]);
}
