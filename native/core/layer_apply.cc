// The layer applier (layer_apply.h).
#include "layer_apply.h"

#include "error.h"

namespace vmspace {

LayerApplyResult applyLayer(int fd, int rootFd, const std::string& rootPath, const LayerApplyOptions& options) {
  throwErrno(ENOSYS, "layerApply", rootPath);
}

}  // namespace vmspace
