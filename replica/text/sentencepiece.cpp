// libsentencepiece, loaded in isolation.
//
// Why not link it: Debian's libsentencepiece carries its own copy of protobuf-lite and exports
// its symbols. LibTorch loads the system libprotobuf.so.32, and in one process the two
// copies interpose each other's symbols: the program crashes before main() (libprotobuf's
// static initializers run into sentencepiece's older copy). So the library is opened with
// dlopen(RTLD_LOCAL | RTLD_DEEPBIND): its symbols stay out of the global scope and its own
// references bind to its own copy. The processor is then used only through virtual calls
// (no link-time symbols); the few non-virtual functions needed (constructor, util::Status's
// destructor and ToString, the trainer) are looked up with dlsym, and a util::Status is
// never destroyed by compiled code here (StatusHolder calls the library's destructor).
// A library opened with RTLD_DEEPBIND sees libstdc++'s own std::cerr, not the program's
// (copy-relocated, the one that is constructed), so its logging is switched off.
#include <dlfcn.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <new>

#include "replica/core/error.h"
#include "replica/text/tokenizer_impl.h"

namespace replica::text::detail {

namespace {

using sentencepiece::SentencePieceProcessor;
using sentencepiece::util::Status;

void* open_isolated(const std::vector<const char*>& names) {
  std::string errors;
  for (const char* name : names) {
    if (void* h = ::dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND)) return h;
    const char* e = ::dlerror();
    errors += fmt::format("{}{}", errors.empty() ? "" : "; ", e ? e : name);
  }
  fail("cannot load SentencePiece ({}); install libsentencepiece0", errors);
}

void* symbol(void* handle, const char* name) {
  void* s = ::dlsym(handle, name);
  if (s == nullptr) fail("SentencePiece library lacks {}", name);
  return s;
}

struct Library {
  void* handle = nullptr;
  void (*construct)(void* self) = nullptr;                         // SentencePieceProcessor()
  void (*destroy_status)(Status* self) = nullptr;                  // Status::~Status()
  std::string (*status_string)(const Status* self) = nullptr;      // Status::ToString()
};

const Library& library() {
  static const Library lib = [] {
    Library l;
    l.handle = open_isolated({"libsentencepiece.so.0", "libsentencepiece.so"});
    l.construct = reinterpret_cast<void (*)(void*)>(
        symbol(l.handle, "_ZN13sentencepiece22SentencePieceProcessorC1Ev"));
    l.destroy_status = reinterpret_cast<void (*)(Status*)>(
        symbol(l.handle, "_ZN13sentencepiece4util6StatusD1Ev"));
    l.status_string = reinterpret_cast<std::string (*)(const Status*)>(
        symbol(l.handle, "_ZNK13sentencepiece4util6Status8ToStringB5cxx11Ev"));
    // Its LOG() writes to std::cerr, which a library opened with RTLD_DEEPBIND must not
    // touch (the program's copy of std::cerr is the one constructed): only FATAL, which
    // aborts anyway, stays on. Failures come back as util::Status.
    reinterpret_cast<void (*)(int)>(
        symbol(l.handle, "_ZN13sentencepiece7logging14SetMinLogLevelEi"))(3);
    return l;
  }();
  return lib;
}

// A util::Status made by the library, destroyed by the library.
class StatusHolder {
 public:
  template <typename Make>
  explicit StatusHolder(Make&& make) {
    new (storage_) Status(make());  // C++17: the callee builds the Status right here
  }
  ~StatusHolder() { library().destroy_status(get()); }
  StatusHolder(const StatusHolder&) = delete;
  StatusHolder& operator=(const StatusHolder&) = delete;
  bool ok() const { return get()->ok(); }
  std::string message() const { return library().status_string(get()); }

 private:
  Status* get() const { return std::launder(reinterpret_cast<Status*>(storage_)); }
  alignas(Status) mutable unsigned char storage_[sizeof(Status)];
};

SentencePieceProcessor* processor(void* p) { return static_cast<SentencePieceProcessor*>(p); }

}  // namespace

SentencePieceModel::SentencePieceModel(const std::string& path) {
  const Library& lib = library();
  void* memory = ::operator new(sizeof(SentencePieceProcessor));
  lib.construct(memory);
  sp_ = memory;
  const StatusHolder status([&] { return processor(sp_)->Load(path); });
  if (!status.ok()) {
    const std::string message = status.message();
    delete processor(sp_);  // virtual: the library's destructor
    sp_ = nullptr;
    fail("tokenizer.model '{}' does not load: {}", path, message);
  }
}

SentencePieceModel::~SentencePieceModel() {
  if (sp_ != nullptr) delete processor(sp_);
}

std::vector<int> SentencePieceModel::encode(std::string_view text) const {
  std::vector<int> ids;
  auto method = static_cast<Status (SentencePieceProcessor::*)(absl::string_view, std::vector<int>*)
                                const>(&SentencePieceProcessor::Encode);
  const StatusHolder status([&] { return (processor(sp_)->*method)(text, &ids); });
  if (!status.ok()) fail("SentencePiece encode failed: {}", status.message());
  return ids;
}

std::string SentencePieceModel::decode(const std::vector<int>& ids) const {
  std::string text;
  auto method = static_cast<Status (SentencePieceProcessor::*)(const std::vector<int>&, std::string*)
                                const>(&SentencePieceProcessor::Decode);
  const StatusHolder status([&] { return (processor(sp_)->*method)(ids, &text); });
  if (!status.ok()) fail("SentencePiece decode failed: {}", status.message());
  return text;
}

int SentencePieceModel::size() const { return processor(sp_)->GetPieceSize(); }
std::string SentencePieceModel::piece(int id) const { return processor(sp_)->IdToPiece(id); }
int SentencePieceModel::piece_to_id(const std::string& piece) const {
  return processor(sp_)->PieceToId(piece);
}
bool SentencePieceModel::is_control(int id) const { return processor(sp_)->IsControl(id); }
bool SentencePieceModel::is_unknown(int id) const { return processor(sp_)->IsUnknown(id); }
int SentencePieceModel::unk_id() const { return processor(sp_)->unk_id(); }
int SentencePieceModel::bos_id() const { return processor(sp_)->bos_id(); }
int SentencePieceModel::eos_id() const { return processor(sp_)->eos_id(); }
int SentencePieceModel::pad_id() const { return processor(sp_)->pad_id(); }

void train_sentencepiece(const std::string& args) {
  library();  // the trainer library needs libsentencepiece loaded the same way
  static void* handle = open_isolated({"libsentencepiece_train.so.0", "libsentencepiece_train.so"});
  using Train = Status (*)(absl::string_view, sentencepiece::SentenceIterator*, std::string*);
  const auto train = reinterpret_cast<Train>(symbol(
      handle,
      "_ZN13sentencepiece20SentencePieceTrainer5TrainESt17basic_string_viewIcSt11char_"
      "traitsIcEEPNS_16SentenceIteratorEPNSt7__cxx1112basic_stringIcS3_SaIcEEE"));
  const StatusHolder status([&] { return train(args, nullptr, nullptr); });
  if (!status.ok()) fail("SentencePiece training failed: {}", status.message());
}

}  // namespace replica::text::detail
