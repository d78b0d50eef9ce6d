// The commit stamp (CLUSTERIP_BUILD_COMMIT): the same build script as the controller's.
include!("../build.rs");
