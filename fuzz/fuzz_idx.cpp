// idx files (Fashion-MNIST, replica/data/fashion_mnist.h). Input bytes 0-1: the length of
// the images file (little-endian, capped by the input); the rest after it is the labels file.
#include "fuzz_input.h"
#include "replica/core/error.h"
#include "replica/data/fashion_mnist.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t images = std::min<size_t>(data[0] | size_t{data[1]} << 8, size - 2);
  replica::fuzz::write_file("train-images-idx3-ubyte", data + 2, images);
  replica::fuzz::write_file("train-labels-idx1-ubyte", data + 2 + images, size - 2 - images);
  try {
    (void)replica::data::load_fashion_mnist(replica::fuzz::scratch_dir(), "train");
  } catch (const replica::Error& e) {
    replica::fuzz::check_message(e);
  }
  return 0;
}
