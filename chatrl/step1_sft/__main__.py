from chatrl.step1_sft.main import main

main()
