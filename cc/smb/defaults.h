// The defaults of a job, in one place: the core, the TF op registrations,
// the pybind module (tf_smb._box.DEFAULTS) and through it the Python package
// and launcher all take them from here.
#ifndef TF_SMB_CC_SMB_DEFAULTS_H_
#define TF_SMB_CC_SMB_DEFAULTS_H_

#include <cstddef>

namespace smb {

// Seconds any wait for other ranks lasts before failing, naming them.
constexpr double kDefaultTimeoutS = 600.0;
// Staging memory per rank and per buffer. Small chunks stay in the caches
// while the ranks pass them around (1 MiB was fastest for ResNet-50's
// gradients on 2 workers; 16 MiB took 1.4x as long).
constexpr size_t kDefaultStagingBytes = size_t{1} << 20;
// Room for result buffers and named segments (parameters in the asynchronous
// mode). The box is sparse: untouched pages cost no memory, so a generous
// default fits large models (VGG-16 with momentum needs ~1.1 GB).
constexpr size_t kDefaultHeapBytes = size_t{4} << 30;

}  // namespace smb

#endif  // TF_SMB_CC_SMB_DEFAULTS_H_
