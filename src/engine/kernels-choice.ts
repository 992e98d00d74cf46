/**
 * The choice of kernel set (`--kernels`, src/kernels/choose-kernels.ts) as the server's config
 * reads it: re-exported from here, not from forward-setup.ts, so that parsing `kvfence serve`'s
 * flags loads the kernels' self-test and not the forward pass.
 */
export { chooseKernels, type KernelsChoice, type KernelsRequest } from "../kernels/choose-kernels.js";
