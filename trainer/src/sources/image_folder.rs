//! `[data] source = "image-folder"` (cargo feature `image-folder`): one sub-folder per class
//! holding its images, the layout of burn-dataset's `ImageFolderDataset`
//! (`root/<class>/<image>`; classes are the sub-folder names in sorted order, class `i` the
//! `i`-th; PNG, JPEG and BMP files, by extension, in any case). `data.labels`, when given,
//! names the class folders to use, in label order.
//!
//! Opening lists the folders (names only, no image is read). `get(i)` decodes image `i`
//! (format from its content), converts it to one grey channel (luma; alpha dropped: the CNN
//! takes one channel), resizes it to `data.image_size = [height, width]` (bilinear) unless it
//! already has that size, and scales the pixels to `[0, 1]`, row-major. A rank decodes only
//! the images of its shard; an image that cannot be decoded is an error naming its file when
//! it is read.
//!
//! Not burn-dataset's `ImageFolderDataset` itself: its `get` panics on an image it cannot
//! decode (a worker thread's panic, not a message), it keeps every channel as a `PixelDepth`
//! enum without resizing, and it comes with Burn's `vision` feature (burn-vision, and an HTTP
//! client for its downloaders).

use std::path::{Path, PathBuf};

use burn::data::dataset::{Dataset, DatasetError};
use image::imageops::FilterType;
use image::ImageReader;

use crate::data::ClassificationItem;
use crate::sources::error::SourceError;

/// The image files read, by extension (ImageFolderDataset's).
pub const IMAGE_EXTENSIONS: [&str; 4] = ["bmp", "jpg", "jpeg", "png"];

/// Which sub-folders are the classes.
#[derive(Debug, Clone, Copy)]
pub enum ClassFolders<'a> {
    /// Every sub-folder, sorted by name; there must be this many (`data.classes`).
    All(usize),
    /// These, in this order (`data.labels`).
    Named(&'a [String]),
}

/// The images of a class folder tree (module docs).
#[derive(Debug, Clone)]
pub struct ImageFolder {
    /// Every image and its class, class by class, each class's files sorted by name.
    images: Vec<(PathBuf, usize)>,
    /// The class names, by class index (the tests check their order).
    #[cfg_attr(not(test), allow(dead_code))]
    classes: Vec<String>,
    height: u32,
    width: u32,
}

impl ImageFolder {
    /// Lists the class folders of `root` and their images; images are `height` x `width`
    /// once read.
    ///
    /// # Errors
    ///
    /// [`SourceError::Open`] (no such folder), [`SourceError::Empty`] (no class folder, a class
    /// folder without images, not as many class folders as `data.classes`, a label with no
    /// folder), [`SourceError::Read`] (a folder that cannot be listed).
    pub fn open(
        root: &Path,
        classes: ClassFolders<'_>,
        height: u32,
        width: u32,
    ) -> Result<Self, SourceError> {
        let folders = sub_folders(root)?;
        let empty = |what: String| SourceError::Empty {
            path: root.to_owned(),
            what,
        };
        if folders.is_empty() {
            return Err(empty(
                "has no class sub-folders: the image-folder source needs one sub-folder per class, holding its images".into(),
            ));
        }
        let classes = match classes {
            ClassFolders::All(count) if count != folders.len() => {
                return Err(empty(format!(
                    "has {} class sub-folders ({}), but data.classes is {count}",
                    folders.len(),
                    folders.join(", ")
                )))
            }
            ClassFolders::All(_) => folders,
            ClassFolders::Named(labels) => {
                if let Some(label) = labels.iter().find(|l| !folders.contains(l)) {
                    return Err(empty(format!(
                        "has no sub-folder '{label}' (data.labels); its sub-folders: {}",
                        folders.join(", ")
                    )));
                }
                labels.to_vec()
            }
        };
        let mut images = Vec::new();
        for (class, name) in classes.iter().enumerate() {
            let files = class_images(&root.join(name), class)?;
            images.extend(files.into_iter().map(|path| (path, class)));
        }
        Ok(Self {
            images,
            classes,
            height,
            width,
        })
    }

    /// The class names, by class index.
    #[cfg(test)]
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// Image `index` (`< len`) as an item, or why it cannot be decoded.
    pub fn read(&self, index: usize) -> Result<ClassificationItem, SourceError> {
        let (path, label) = &self.images[index];
        let image_error = |message: String| SourceError::Image {
            path: path.clone(),
            message,
        };
        let image = ImageReader::open(path)
            .and_then(ImageReader::with_guessed_format)
            .map_err(|e| image_error(e.to_string()))?
            .decode()
            .map_err(|e| image_error(e.to_string()))?;
        let mut grey = image.into_luma8();
        if grey.dimensions() != (self.width, self.height) {
            grey = image::imageops::resize(&grey, self.width, self.height, FilterType::Triangle);
        }
        let features = grey
            .into_raw()
            .into_iter()
            .map(|p| f32::from(p) / 255.0)
            .collect();
        Ok(ClassificationItem {
            features,
            label: *label,
        })
    }
}

/// [`ImageFolder::open`] as the data set the apps split: the classes are `labels` when given,
/// else every sub-folder (there must be `classes`).
pub fn dataset(
    root: &Path,
    labels: Option<&[String]>,
    classes: usize,
    height: u32,
    width: u32,
) -> Result<Box<dyn Dataset<ClassificationItem>>, SourceError> {
    let classes = match labels {
        Some(labels) => ClassFolders::Named(labels),
        None => ClassFolders::All(classes),
    };
    Ok(Box::new(ImageFolder::open(root, classes, height, width)?))
}

/// A file with one of [`IMAGE_EXTENSIONS`] (any case).
fn is_image(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| IMAGE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
        && path.is_file()
}

impl Dataset<ClassificationItem> for ImageFolder {
    /// The image, or why it cannot be decoded (a [`SourceError`] naming the file).
    ///
    /// # Panics
    ///
    /// If `index >= len()` (Burn's `Dataset::get` contract).
    fn get(&self, index: usize) -> Result<ClassificationItem, DatasetError> {
        let len = self.images.len();
        assert!(
            index < len,
            "image folder: index {index} out of range (it has {len} images)"
        );
        self.read(index).map_err(DatasetError::new)
    }

    fn len(&self) -> usize {
        self.images.len()
    }
}

/// The visible sub-folders of `root` (links followed), sorted.
fn sub_folders(root: &Path) -> Result<Vec<String>, SourceError> {
    let entries = std::fs::read_dir(root).map_err(|error| SourceError::Open {
        path: root.to_owned(),
        error,
    })?;
    let mut folders = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|error| SourceError::Read {
            path: root.to_owned(),
            error,
        })?;
        let name = entry.file_name().to_string_lossy().into_owned();
        // `metadata` follows links: a linked class folder counts.
        if !name.starts_with('.') && std::fs::metadata(entry.path()).is_ok_and(|m| m.is_dir()) {
            folders.push(name);
        }
    }
    folders.sort();
    Ok(folders)
}

/// The image files of class `class`'s folder, sorted; a folder without any is an error.
fn class_images(folder: &Path, class: usize) -> Result<Vec<PathBuf>, SourceError> {
    let listing = std::fs::read_dir(folder).map_err(|error| SourceError::Read {
        path: folder.to_owned(),
        error,
    })?;
    let mut files = Vec::new();
    for entry in listing {
        let path = entry
            .map_err(|error| SourceError::Read {
                path: folder.to_owned(),
                error,
            })?
            .path();
        if is_image(&path) {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(SourceError::Empty {
            path: folder.to_owned(),
            what: format!(
                "(class {class}) holds no images ({})",
                IMAGE_EXTENSIONS.map(|e| format!(".{e}")).join(", ")
            ),
        });
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{GrayImage, Luma, Rgb, RgbImage};

    fn folder(name: &str) -> PathBuf {
        let dir = std::env::temp_dir()
            .join(format!("trainer-images-{}", std::process::id()))
            .join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn grey(path: &Path, w: u32, h: u32, value: u8) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        GrayImage::from_pixel(w, h, Luma([value]))
            .save(path)
            .unwrap();
    }

    #[test]
    fn classes_are_sorted_folders_and_images_grey_resized_scaled() {
        let root = folder("ok");
        grey(&root.join("b/x.png"), 4, 2, 255);
        grey(&root.join("a/2.PNG"), 2, 2, 0);
        RgbImage::from_pixel(3, 3, Rgb([255, 255, 255]))
            .save(root.join("a/1.bmp"))
            .unwrap();
        std::fs::write(root.join("a/notes.txt"), "ignored").unwrap();
        std::fs::create_dir_all(root.join(".hidden")).unwrap();
        let data = ImageFolder::open(&root, ClassFolders::All(2), 2, 2).unwrap();
        assert_eq!(data.classes(), ["a", "b"]);
        assert_eq!(data.len(), 3);
        let items: Vec<_> = (0..3).map(|i| data.get(i).unwrap()).collect();
        assert_eq!(items.iter().map(|i| i.label).collect::<Vec<_>>(), [0, 0, 1]);
        assert_eq!(
            items[0].features,
            vec![1.0; 4],
            "RGB white, resized 3x3 -> 2x2"
        );
        assert_eq!(items[1].features, vec![0.0; 4]);
        assert_eq!(items[2].features, vec![1.0; 4]);

        let labels = ["b".to_owned(), "a".to_owned()];
        let named = ImageFolder::open(&root, ClassFolders::Named(&labels), 2, 2).unwrap();
        assert_eq!(named.get(0).unwrap().label, 0);
        assert_eq!(named.len(), 3);
    }

    fn error(root: &Path, classes: ClassFolders<'_>) -> String {
        let message = ImageFolder::open(root, classes, 2, 2)
            .err()
            .map(|e| e.to_string());
        message
            .unwrap_or_default()
            .replace(&root.display().to_string(), "ROOT")
    }

    #[test]
    fn bad_folders_and_images_are_named() {
        let root = folder("bad");
        assert!(error(&root, ClassFolders::All(2)).starts_with("ROOT has no class sub-folders"));
        grey(&root.join("a/1.png"), 2, 2, 1);
        std::fs::create_dir_all(root.join("b")).unwrap();
        std::fs::write(root.join("b/readme.md"), "x").unwrap();
        assert_eq!(
            error(&root, ClassFolders::All(2)),
            "ROOT/b (class 1) holds no images (.bmp, .jpg, .jpeg, .png)"
        );
        assert_eq!(
            error(&root, ClassFolders::All(3)),
            "ROOT has 2 class sub-folders (a, b), but data.classes is 3"
        );
        let labels = ["a".to_owned(), "c".to_owned()];
        assert_eq!(
            error(&root, ClassFolders::Named(&labels)),
            "ROOT has no sub-folder 'c' (data.labels); its sub-folders: a, b"
        );
        assert!(
            error(&root.join("none"), ClassFolders::All(2)).starts_with("cannot open data file")
        );

        std::fs::write(root.join("b/broken.png"), b"\x89PNG\r\n\x1a\n not really").unwrap();
        let data = ImageFolder::open(&root, ClassFolders::All(2), 2, 2).unwrap();
        let message = data
            .read(1)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            message.starts_with(&format!(
                "cannot decode image '{}': ",
                root.join("b/broken.png").display()
            )),
            "{message}"
        );
        assert!(data.read(0).is_ok());
    }
}
