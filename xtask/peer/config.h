/* rdma-core's buildlib/config.h.in as its CMake fills it on x86-64 Linux with gcc (`cargo xtask bench --peer`). */
#ifndef CONFIG_H_IN
#define CONFIG_H_IN

#define HAVE_STATEMENT_EXPR 1
#define HAVE_BUILTIN_TYPES_COMPATIBLE_P 1
#define HAVE_TYPEOF 1
#define HAVE_ISBLANK 1
#define HAVE_BUILTIN_CLZ 1
#define HAVE_BUILTIN_CLZL 1
#define PACKAGE_VERSION "55.0"
#define STREAM_CLOEXEC "e"
#define RDMA_CDEV_DIR "/dev/infiniband"
#define IBV_CONFIG_DIR "/etc/libibverbs.d"
#define VERBS_PROVIDER_DIR "/usr/lib/x86_64-linux-gnu/libibverbs"
#define VERBS_PROVIDER_SUFFIX "-rdmav34.so"
#define IBVERBS_PABI_VERSION 34
#define HAVE_FUNC_ATTRIBUTE_ALWAYS_INLINE 1
#define HAVE_FUNC_ATTRIBUTE_IFUNC 1
#define HAVE_FUNC_ATTRIBUTE_SYMVER 1
#define HAVE_WORKING_IF_H 1
#define HAVE_FULL_SYMBOL_VERSIONS 1
#define SIZEOF_LONG 8
#define VERBS_IOCTL_ONLY 0
#define VERBS_WRITE_ONLY 0
#define IBACM_SERVER_MODE_UNIX 0
#define IBACM_SERVER_MODE_LOOP 1
#define IBACM_SERVER_MODE_OPEN 2
#define IBACM_SERVER_MODE_DEFAULT IBACM_SERVER_MODE_UNIX
#define IBACM_ACME_PLUS_KERNEL_ONLY_DEFAULT 0

#endif
