/**
 * The choice of kernel set (`--kernels`, src/kernels/choose-kernels.ts) as the server's config
 * and a prestarted node thread (which runs the self-test for it) read it: re-exported from here,
 * not from forward-setup.ts, so that parsing `kvfence serve`'s flags loads the kernels' self-test
 * and not the forward pass.
 */
export {
  chooseKernels,
  type KernelsChoice,
  type KernelsRequest,
  nativeSelfTest,
  type SelfTestResult,
} from "../kernels/choose-kernels.js";
