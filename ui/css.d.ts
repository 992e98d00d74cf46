// CSS imports are bundled by esbuild (scripts/build-ui.mjs).
declare module "*.css";
